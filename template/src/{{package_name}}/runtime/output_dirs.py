"""Directories of run output keep themselves out of git.

A directory the harness makes for what a run writes (a local ``checkpoint.dir``,
``log.dir``, the drill's ``--out``, the benchmark's ``--dir``, memcheck's) gets a
``.gitignore`` holding ``*`` as it is made: nothing in it, that file included, ever
shows in ``git status``, wherever in a checkout it lies, so ``copier update`` (which
needs a clean checkout) is never blocked by a run and no checkpoint is committed by
mistake.

Only a directory the harness creates gets one. A directory that exists already is
the user's and is left as it is: it may hold files under version control, or be the
checkout itself (``log.dir=.``), where ``*`` would hide every new file from git. Object
stores and the memory tier's copies (``/dev/shm``) are not in a checkout and get none.
"""

from __future__ import annotations

import os
from pathlib import Path

IGNORE_FILE = ".gitignore"
IGNORE_EVERYTHING = ("# Run output, written by the training harness when it made this "
                     "directory: never in git.\n*\n")


def make_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and its parents) for run output and return it; when this call
    created it, write the ``.gitignore`` that keeps it out of git (``ignore_in_git``).

    An existing directory is left alone. Several processes may call this at once (every
    rank makes ``log.dir``): the one whose ``mkdir`` succeeded writes the file. Raises
    OSError when the directory cannot be made (a file of that name, no permission).
    """
    path = Path(path)
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
    except FileExistsError:
        if path.is_dir():   # another process made it a moment ago: that one writes it
            return path
        raise
    ignore_in_git(path)
    return path


def ignore_in_git(directory: str | os.PathLike) -> bool:
    """Write ``.gitignore`` (``*``) into ``directory``, which the harness has just made
    (``tempfile.mkdtemp`` too); an existing ``.gitignore`` is never replaced. Returns
    whether it was written."""
    target = Path(directory) / IGNORE_FILE
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(IGNORE_EVERYTHING)
    return True
