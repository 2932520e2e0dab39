"""Checkpointing: the checkpointer the training loop talks to (``checkpointer.py``), the
save decisions beside it (``policy.py``, ``failed_saves.py``), the training state it saves
(``state.py``), and four wings, each importing only the ones after it: ``memory/`` (RAM
copies of a node and its partner; copier answer memory_tier), ``save/``, ``load/`` (which
checkpoint to load), ``store/`` (storage, layout, checksums, lease).

Names are looked up when first used (PEP 562), so the commands that import only ``store``
(plan, goodput) stay free of torch.
"""

from importlib import import_module

_WHERE = {name: module for module, names in {
    ".checkpointer": ("CheckpointRefused", "Checkpointer", "StepDecision", "TrainingState"),
    ".load.restore": ("CheckpointUnusable", "IncompatibleCheckpoint"),
    ".save.pipeline": ("SavePipeline",),
    ".save.commit": ("SaveResult",),
    ".store.layout": ("Committed", "list_committed", "newest_complete_checkpoint", "step_name"),
    ".store.storage": ("LocalStorage", "open_storage"),
}.items() for name in names}

def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
