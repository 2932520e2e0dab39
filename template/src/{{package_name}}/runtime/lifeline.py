"""A child process of a training worker ends within a second of the worker's death.

A worker's children (DCP's background checkpoint process, spawned: a new Python that
imports this package's command as ``__mp_main__``; DataLoader workers) outlive a worker
killed with SIGKILL: re-parented, a checkpoint process was seen alive 7 minutes later,
holding its memory and retrying its connection to the dead worker's store. So each child
watches the process above it: a thread looks every ``POLL_S`` and ends the child with
``os._exit`` once its parent has changed, whatever it is doing; a save cut off so is
never committed (only the worker commits). The calls: ``hand_down`` in the worker,
``follow_parent`` and ``say_if_heard`` in the child; ``on_parent_gone`` also lets the
agent watch ``resume``. This module imports nothing heavy: a spawned child starts
watching before it imports torch. docs/PREEMPTION.md, "What happens" (the drain) and the
table of processes killed outright.
"""

from __future__ import annotations

import os
import select
import signal
import threading
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
    """In a child: end this process once its parent is no longer the one it started with.

    The parent is the worker named by ``hand_down`` when that worker is this process's
    parent or has died (the child was orphaned while starting: it ends here and now);
    otherwise (a DataLoader worker's own child, a forkserver's) the parent of this moment,
    whose children are then told it is theirs. ``stop_signals``: see ``_only_from``.
    """
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
    """Call ``action`` once, in a daemon thread, when this process's parent is no longer
    ``parent`` (it died: the process was re-parented). Looked at every ``POLL_S``."""
    def watch() -> None:
        event = threading.Event()
        while not event.wait(POLL_S):
            if os.getppid() != parent:
                action()
                return

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def die_with_parent(parent: int) -> None:
    """End this process with SIGKILL the moment ``parent`` (its parent now) ends; at once
    if it already has. Linux; elsewhere nothing (``on_parent_gone`` is the portable way,
    at the cost of a thread)."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(EXIT_STATUS)


def say_if_heard(line: str) -> None:
    """Write ``line`` to stderr if it can take it now; never block, never change fd 2.

    (Its open file is shared with the other processes of the job: a flag set on it would
    be theirs too.)
    """
    try:
        if select.select([], [2], [], 0)[1]:
            os.write(2, (line.rstrip("\n") + "\n").encode()[:512])   # below PIPE_BUF
    except (OSError, ValueError):
        pass


def _only_from(parent: int, stop_signals: Sequence[int]) -> None:
    """``stop_signals`` end this process when ``parent`` sends them, and only then.

    torchrun's agent stops its workers with a signal to each worker's process group, and a
    terminal's Ctrl-C or a scheduler's signal reaches the whole group too. DCP's checkpoint
    process is in that group: ended first, it cuts off the background save in flight (the
    save fails; a traceback comes from the worker's end of their pipe). The worker's stop
    path decides instead; the signal its parent sends (multiprocessing ends a daemon child
    with SIGTERM at the parent's exit) ends it as before. Blocked in every thread, taken
    by one that reads the sender (Linux; elsewhere, without ``sigwaitinfo``, they act as
    they always did).
    """
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
