"""Checkpointing: the checkpointer the training loop talks to (``checkpointer.py``), the
save decisions beside it (``policy.py``, ``failed_saves.py``), the training state it saves
(``state.py``), and below them four wings, each importing only the ones after it:

    memory/   the memory tier: copies in RAM of a node and of its partner node
              (rendered with the copier answer memory_tier)
    save/     the save pipeline: async save, staging, the background process
    load/     which checkpoint to load, read once and checked as it is read
    store/    where checkpoints live: storage, the layout (name, commit, retire), checksums, lease

The names below are looked up when first used (PEP 562), not at import: the commands
that only read settings and records (plan, goodput) import ``store`` and so this package,
and stay free of torch, which the checkpointer imports (about 2.5 s of CPU a process).
"""

from importlib import import_module

# Each name the package offers -> the module that defines it.
_WHERE = {
    "CheckpointRefused": ".checkpointer",
    "Checkpointer": ".checkpointer",
    "StepDecision": ".checkpointer",
    "TrainingState": ".checkpointer",
    "CheckpointUnusable": ".load.restore",
    "IncompatibleCheckpoint": ".load.restore",
    "SavePipeline": ".save.pipeline",
    "SaveResult": ".save.commit",
    "Committed": ".store.layout",
    "list_committed": ".store.layout",
    "newest_complete_checkpoint": ".store.layout",
    "step_name": ".store.layout",
    "LocalStorage": ".store.storage",
    "open_storage": ".store.storage",
}

def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
