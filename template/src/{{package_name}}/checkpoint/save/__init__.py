"""The save pipeline: DCP's async save, the staging copy, the background process, the planner."""
