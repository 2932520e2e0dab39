"""Training that survives interruptions: sharded async checkpoints, resume on any GPU count.

The package root holds your room (``task.py``, ``models/``, ``datasets/``) and the
commands (``python -m <package>.train``, ``.resume``, ``.drill``, ``.plan``, ``.bench``,
``.export``, ``.verify``, ``.prepare_data``, ``.memcheck``); each folder holds one concern
of the harness (docs/EXTENDING.md has the map).
"""

__version__ = "0.1.0"
PACKAGE = __name__  # what `python -m <package>.<command>` names
