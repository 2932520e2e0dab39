"""Checkpointing: the save pipeline, the commit protocol and the storage behind them."""

from .layout import Committed, list_committed, newest_complete_checkpoint, step_name
from .manager import CheckpointManager, SaveResult
from .storage import LocalStorage, open_storage

__all__ = [
    "CheckpointManager",
    "Committed",
    "LocalStorage",
    "SaveResult",
    "list_committed",
    "newest_complete_checkpoint",
    "open_storage",
    "step_name",
]
