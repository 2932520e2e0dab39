"""Checkpointing: the checkpointer the training loop talks to (``checkpointer.py``), and
below it the save decisions, the save pipeline, the commit protocol and the storage."""

from .checkpointer import Checkpointer, CheckpointRefused, StepDecision, TrainingState
from .layout import Committed, list_committed, newest_complete_checkpoint, step_name
from .manager import CheckpointManager, SaveResult
from .restore import CheckpointUnusable, IncompatibleCheckpoint
from .storage import LocalStorage, open_storage

__all__ = [
    "CheckpointManager",
    "CheckpointRefused",
    "CheckpointUnusable",
    "Checkpointer",
    "Committed",
    "IncompatibleCheckpoint",
    "LocalStorage",
    "SaveResult",
    "StepDecision",
    "TrainingState",
    "list_committed",
    "newest_complete_checkpoint",
    "open_storage",
    "step_name",
]
