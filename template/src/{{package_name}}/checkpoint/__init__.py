"""Checkpointing: the checkpointer the training loop talks to (``checkpointer.py``), the
save decisions beside it (``policy.py``, ``failed_saves.py``), the training state it saves
(``state.py``), and four wings, each importing only the ones after it: ``memory/`` (RAM
copies of a node and its partner; copier answer memory_tier), ``save/``, ``load/`` (which
checkpoint to load), ``store/`` (storage, layout, checksums, lease).

Names are looked up when first used (PEP 562), so the commands that import only ``store``
(plan, goodput) stay free of torch.
"""

from importlib import import_module

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
