"""Checkpointing: the checkpointer the training loop talks to (``checkpointer.py``), the
save decisions beside it (``policy.py``, ``failed_saves.py``), the training state it saves
(``state.py``), and below them four wings, each importing only the ones after it:

    memory/   the memory tier: copies in RAM of a node and of its partner node
              (rendered with the copier answer memory_tier)
    save/     the save pipeline: async save, staging, the background process
    load/     which checkpoint to load, read once and checked as it is read
    store/    where checkpoints live: storage, the layout (name, commit, retire), checksums, lease
"""

from .checkpointer import Checkpointer, CheckpointRefused, StepDecision, TrainingState
from .load.restore import CheckpointUnusable, IncompatibleCheckpoint
from .save.pipeline import SavePipeline, SaveResult
from .store.layout import Committed, list_committed, newest_complete_checkpoint, step_name
from .store.storage import LocalStorage, open_storage

__all__ = [
    "CheckpointRefused",
    "CheckpointUnusable",
    "Checkpointer",
    "Committed",
    "IncompatibleCheckpoint",
    "LocalStorage",
    "SavePipeline",
    "SaveResult",
    "StepDecision",
    "TrainingState",
    "list_committed",
    "newest_complete_checkpoint",
    "open_storage",
    "step_name",
]
