"""Loading a checkpoint: which one, read once and checked as read, nothing run from it."""
