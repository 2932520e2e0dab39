"""Directories of run output keep themselves out of git.

A directory the harness makes for run output (a local ``checkpoint.dir``, ``log.dir``, ...)
gets a ``.gitignore`` holding ``*``, so ``copier update`` (which needs a clean checkout) is
never blocked by a run. One that exists already is the user's and is left alone (it may
be the checkout itself: ``log.dir=.``).
"""

from __future__ import annotations

import os
from pathlib import Path

IGNORE_FILE = ".gitignore"
IGNORE_EVERYTHING = ("# Run output, written by the training harness when it made this "
                     "directory: never in git.\n*\n")


def make_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and its parents) and return it; the one caller whose ``mkdir`` made
    it (every rank makes ``log.dir``) writes its ``.gitignore``. OSError if it cannot."""
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
    """Write ``.gitignore`` into a just-made ``directory`` (never over one); whether it did."""
    target = Path(directory) / IGNORE_FILE
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(IGNORE_EVERYTHING)
    return True
