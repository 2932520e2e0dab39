"""The tools behind the commands: bench, drill, export, verify, memcheck, prepare_data."""
