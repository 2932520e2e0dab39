"""The save-interval plan: its inputs, its formulas (the one source), its report and plot (the `plan` command: tools/plan.py)."""
