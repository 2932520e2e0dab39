"""A child process of a training worker ends within a second of the worker's death.

A worker's children (DCP's checkpoint process, spawned: it imports this package's command
as ``__mp_main__``; DataLoader workers) outlive a worker killed with SIGKILL. So each has
a thread that ends it with ``os._exit`` once its parent changed (a save cut off so is
never committed): ``hand_down`` in the worker, ``follow_parent`` in the child. Nothing
heavy is imported: a spawned child watches before it imports torch. docs/PREEMPTION.md.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence

from .. import PACKAGE
from .process_tree import alive, prctl

PARENT_ENV = f"{PACKAGE.upper()}_WORKER_PID"   # the worker's pid, as its children inherit it
TORCHRUN_ENV = f"{PACKAGE.upper()}_TORCHRUN_PID"   # a forked worker's torchrun (launch/warm.py)
POLL_S = 0.25
PR_SET_PDEATHSIG = 1   # linux/prctl.h
EXIT_STATUS = 1


def hand_down() -> None:
    """In a worker: tell the children it starts from now on who their parent is."""
    os.environ[PARENT_ENV] = str(os.getpid())


def follow_parent(stop_signals: Sequence[int] = ()) -> None:
    """In a child: end this process once its parent is no longer the one it started with
    (at once if the handed-down worker died already; ``stop_signals``: ``_only_from``)."""
    parent = os.getppid()
    if stop_signals:
        _only_from(parent, stop_signals)   # before any thread starts: they inherit the mask
    handed = os.environ.get(PARENT_ENV, "")
    if handed.isdigit() and int(handed) != parent:
        if not alive(int(handed)):
            _end(int(handed))
        hand_down()
    on_parent_gone(parent, lambda: _end(parent), name="lifeline")


def on_parent_gone(parent: int, action: Callable[[], None], *, name: str) -> threading.Thread:
    """Call ``action`` once (a daemon thread) when this process's parent is not ``parent``."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        action()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def die_with_parent(parent: int) -> None:
    """SIGKILL this process the moment ``parent`` (its parent now) ends; at once if it has.
    Linux only (``on_parent_gone`` is the portable way, at the cost of a thread)."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(EXIT_STATUS)


def say_if_heard(line: str) -> None:
    """Write ``line`` to stderr if it can take it now; never block, never change fd 2 (its
    open file is shared with the job's other processes: a flag set on it would be theirs)."""
    with contextlib.suppress(OSError, ValueError):
        if select.select([], [2], [], 0)[1]:
            os.write(2, (line.rstrip("\n") + "\n").encode()[:512])   # below PIPE_BUF


def _only_from(parent: int, stop_signals: Sequence[int]) -> None:
    """``stop_signals`` end this process when ``parent`` sends them, and only then: one sent
    to the worker's whole process group must not cut off DCP's save in flight. Needs
    ``sigwaitinfo`` (Linux); elsewhere the signals act as they always did."""
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(stop_signals)
            if info.si_pid == parent:
                os._exit(128 + info.si_signo)   # as the signal's default action would

    threading.Thread(target=take, name="lifeline-signals", daemon=True).start()


def _end(parent: int) -> None:
    say_if_heard(f"process {os.getpid()}: its parent {parent} is gone; ending it (a save it "
                 "was writing is not committed)")
    os._exit(EXIT_STATUS)
