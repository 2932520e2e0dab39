"""The memory tier: copies of the training state in RAM of its node and of a partner node."""
