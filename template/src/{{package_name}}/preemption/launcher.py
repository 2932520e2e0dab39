"""A worker whose launcher died stops within the grace period, and leaves nothing behind.

``LauncherWatch`` checks the parent every ``POLL_S``; once it is gone (torchrun without
``--signals-to-handle`` dies of a SIGUSR1; any launcher can be killed) it asks for a stop
(``launcher-gone``) as on a preemption, and ``grace_s - MARGIN_S`` later ends the process's
children, then the process (``os._exit``): a save cut off there has no commit record and never
counts. docs/PREEMPTION.md, "Bounded waits".
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable

from ..runtime.exit_codes import error_text
from ..runtime.lifeline import TORCHRUN_ENV, say_if_heard
from .watch import PreemptionWatch

POLL_S = 0.25         # how often the parent is looked at
# The hard end comes this much before the grace period is over: room for POLL_S and the
# exit itself (children killed, reaped: up to 1.2 s on 2 busy cores).
MARGIN_S = 2.0
MIN_DEADLINE_S = 3.0  # never sooner than this after the launcher was seen gone

SOURCE = "launcher-gone"


def launcher_pid() -> int | None:
    """The parent that must outlive this worker (torchrun, or the zygote a warm-started
    worker was forked from: launch/zygote.py), or None outside torchrun."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def torchrun_pid() -> int | None:
    """torchrun's agent: the parent, or a forked worker's stand-in's parent."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    handed = os.environ.get(TORCHRUN_ENV, "")
    return int(handed) if handed.isdigit() else os.getppid()


def describe(pid: int) -> str:
    return f"the parent process {pid} (torchrun) has exited"


class LauncherWatch:
    """``status`` gives a hard end's exit status (called from this thread: it must only read)."""

    def __init__(self, watch: PreemptionWatch, pid: int, grace_s: float,
                 status: Callable[[], int], poll_s: float = POLL_S) -> None:
        self.watch = watch
        self.pid = pid
        self.deadline_s = max(grace_s - MARGIN_S, MIN_DEADLINE_S)
        self.status = status
        self.poll_s = poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop looking at the launcher. A hard end already armed stays armed: the exit itself
        can block (a traceback written to an output pipe nobody reads any more)."""
        self._done.set()

    def _run(self) -> None:
        while os.getppid() == self.pid:
            if self._done.wait(self.poll_s):
                return
        self.watch.request(SOURCE, describe(self.pid))
        time.sleep(self.deadline_s)   # a process that ends in time takes this thread along
        end_now(self.status(), f"the launcher (pid {self.pid}) is gone and this worker did "
                               f"not end within {self.deadline_s:g} s: ending it now; the "
                               "newest committed checkpoint is the one to resume from")


def end_now(status: int, sentence: str) -> None:
    """Kill this process's children, say one line if stderr takes it, and exit."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError):
            child.kill()
    say_if_heard(error_text(f"{sentence} (exit status {status})"))   # nobody may read any more
    time.sleep(0.1)  # the children's SIGKILL is delivered before their parent goes
    os._exit(status)
