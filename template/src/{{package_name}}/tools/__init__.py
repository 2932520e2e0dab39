"""The tools behind the commands: plan, bench, drill, export, verify, memcheck, prepare_data."""
