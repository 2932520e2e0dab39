"""The save pipeline: DCP's async save, the staging copy, the background checkpoint
process, DCP's save planner."""
