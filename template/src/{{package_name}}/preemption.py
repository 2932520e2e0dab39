"""Preemption: notice that the machine is going away and ask the loop to stop.

A signal handler (or a cloud-notice poller) only records the request; the training
loop reads it at a step boundary, where all ranks vote so that they stop at the same
step even when only one of them was told.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopRequest:
    source: str          # "SIGTERM", "SIGUSR1", "aws-notice", ...
    wall_time: float     # when it arrived (time.time(), comparable across ranks)


class PreemptionWatch:
    """Collects stop requests from signals and notice pollers; thread- and signal-safe."""

    def __init__(self, signals: list[str]) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        if signal.SIGINT not in self.signals:
            self.signals.append(signal.SIGINT)
        self._first: StopRequest | None = None
        self._count = 0
        self._lock = threading.RLock()  # a second signal may land inside the handler
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame) -> None:
        # Only record: anything heavier inside a handler can deadlock with the loop.
        self.request(signal.Signals(signum).name)

    def request(self, source: str) -> None:
        """Ask for a stop; later requests are counted but change nothing."""
        with self._lock:
            self._count += 1
            if self._first is None:
                self._first = StopRequest(source, time.time())

    @property
    def requested(self) -> StopRequest | None:
        return self._first

    @property
    def count(self) -> int:
        return self._count
