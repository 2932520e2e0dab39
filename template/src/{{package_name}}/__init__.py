"""Training that survives interruptions: sharded async checkpoints, resume on any GPU count."""

__version__ = "0.1.0"
