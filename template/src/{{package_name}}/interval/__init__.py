"""The save-interval plan: its formulas (the one source), its report and plot, its command."""
