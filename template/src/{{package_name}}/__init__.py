"""Training that survives interruptions: sharded async checkpoints, resume on any GPU count.

The root holds your task (``task.py``), the library it composes (``models/``, ``datasets/``)
and one module per command (``python -m <package>.train``, ``.resume``, ...); each folder holds
one concern of the harness (docs/EXTENDING.md has the map, and who owns which file)."""

__version__ = "0.1.0"
PACKAGE = __name__  # what `python -m <package>.<command>` names
