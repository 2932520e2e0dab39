"""Signals that come while a command is still starting are kept, not fatal.

A SIGTERM while torch imports would end the process by the default action (exit 143): an
early preemption would look like a crash. The command entries (``train.py``, ``resume.py``)
call ``hold()`` before their first heavy import; the real handlers, once installed, take the
signals held so far with ``take()``. Only standard-library imports run before ``hold()``.
"""

from __future__ import annotations

import signal

HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_pending: list[signal.Signals] = []
_before: dict[signal.Signals, object] = {}


def _record(signum: int, _frame) -> None:
    _pending.append(signal.Signals(signum))


def hold() -> None:
    """Record HELD signals from now on, until ``take`` hands them over (a second call, in
    a worker forked already holding them, changes nothing)."""
    for sig in HELD:
        if signal.getsignal(sig) is not _record:
            _before[sig] = signal.signal(sig, _record)


def take(handled: list[signal.Signals] | tuple[signal.Signals, ...]) -> list[signal.Signals]:
    """The signals held so far, in order of arrival, once each; nothing is held after. Call
    it right after installing the real handlers for ``handled``: any other HELD signal gets
    back its handler from before ``hold()`` and, if it came meanwhile, is raised again now."""
    held = list(dict.fromkeys(_pending))
    _pending.clear()
    for sig, before in _before.items():
        if sig not in handled and signal.getsignal(sig) is _record:
            signal.signal(sig, before)
    _before.clear()
    for sig in held:
        if sig not in handled:
            signal.raise_signal(sig)
    return [sig for sig in held if sig in handled]
