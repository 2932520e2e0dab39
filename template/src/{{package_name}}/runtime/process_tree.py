"""A process and all its descendants: found through /proc (``ps`` elsewhere), killed at once.

The drill loses a run as a machine is lost: every process of it SIGKILLed at one moment.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path


def prctl(option: int, value: int | ctypes.c_int) -> bool:
    """Linux's ``prctl(option, value)``; False where it failed or is not Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arg = ctypes.byref(value) if isinstance(value, ctypes.c_int) else value
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """Parent pid of every process: /proc on Linux, ``ps`` elsewhere."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True,
                             text=True, check=True).stdout
        return {int(pid): int(ppid) for pid, ppid in (line.split() for line in out.splitlines())}
    parents = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited while we looked
            # The parent pid follows the command name, which may itself contain ") ".
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def children(pid: int) -> list[int]:
    """The direct children of ``pid``, zombies (exited, not yet reaped) included."""
    return [child for child, parent in _parents().items() if parent == pid]


def alive(pid: int) -> bool:
    """``pid`` exists (a zombie counts: it has not been reaped yet), whoever owns it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def command_of(pid: int) -> str:
    """The command line of ``pid``, for a message ("" once it has exited)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def process_tree(root: int) -> list[int]:
    below: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        below.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(below.get(pid, ()))
    return tree


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def kill_tree(root: int) -> int:
    """SIGKILL ``root`` and every descendant (workers have sessions of their own: a process
    group is not enough), all frozen first (SIGSTOP) so none reacts or forks; how many."""
    frozen: set[int] = set()
    while new := [pid for pid in process_tree(root) if pid not in frozen]:
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        frozen.update(new)
    for pid in frozen:
        _signal(pid, signal.SIGKILL)
    return len(frozen)
