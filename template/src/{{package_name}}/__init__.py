"""Training that survives interruptions: sharded async checkpoints, resume on any GPU count.

The package root holds your task (``task.py``), the library it composes (``models/``,
``datasets/``) and the commands (``python -m <package>.train``, ``.resume``, ``.plan``,
``.goodput``, ``.soak``, ``.drill``, ``.bench``, ``.export``, ``.verify``,
``.prepare_data``, ``.memcheck``); each folder holds one concern of the harness
(docs/EXTENDING.md has the map, and says which files ``copier update`` owns).
"""

__version__ = "0.1.0"
PACKAGE = __name__  # what `python -m <package>.<command>` names
