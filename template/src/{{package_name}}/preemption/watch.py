"""Preemption: notice that the machine is going away and ask the loop to stop.

A signal handler (or a cloud-notice poller, notices.py) only records the request; the loop
reads it at a step boundary, where all ranks vote so that they stop at the same step. Cloud
notices are polled by one process per node (local rank 0); the vote carries them to the rest.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass

from ..config import NoticeSource, PreemptionConfig
from ..runtime.exit_codes import INTERRUPTED as INTERRUPTED_EXIT
from . import early


@dataclass(frozen=True)
class StopRequest:
    source: str          # "SIGTERM", "SIGUSR1", "aws-notice", ...
    wall_time: float     # when it arrived (time.time(), comparable across ranks)
    detail: str = ""     # what a notice said, e.g. "terminate at 2026-11-29T10:00:00Z"


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
        for sig in early.take(self.signals):  # came while the command was importing
            self.request(sig.name, "arrived while the command was starting")

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame) -> None:
        # Only record: anything heavier inside a handler can deadlock with the loop.
        name = signal.Signals(signum).name
        if name == "SIGINT" and self._first is not None and self._first.source == "SIGINT":
            self._second_interrupt()
        self.request(name)

    @staticmethod
    def _second_interrupt() -> None:
        """A second Ctrl-C: leave at once, without the final save (nothing torn ever counts)."""
        os.write(2, b"second Ctrl-C: exiting now without a final save; the newest committed "
                    b"checkpoint stays the one to resume from\n")
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(INTERRUPTED_EXIT)

    def request(self, source: str, detail: str = "") -> None:
        """Ask for a stop; later requests are counted but change nothing."""
        with self._lock:
            self._count += 1
            if self._first is None:
                self._first = StopRequest(source, time.time(), detail)

    @property
    def requested(self) -> StopRequest | None:
        return self._first

    @property
    def count(self) -> int:
        return self._count


# Seconds from a cloud's preemption notice to the machine going away (Azure: at least). The
# copy-time checklist has the same table (the template's includes/clouds.jinja; tests compare).
NOTICE_WINDOW_S: dict[NoticeSource, float] = {
    NoticeSource.aws: 120.0, NoticeSource.gcp: 30.0, NoticeSource.azure: 30.0,
}


def effective_grace_s(cfg: PreemptionConfig) -> float:
    """The grace period to plan the stop against: ``grace_period_s``, but never more than
    the configured cloud's notice window, after which the machine is gone anyway."""
    window = NOTICE_WINDOW_S.get(NoticeSource(cfg.notice_source))
    return cfg.grace_period_s if window is None else min(cfg.grace_period_s, window)


__all__ = ["NOTICE_WINDOW_S", "PreemptionWatch", "StopRequest", "effective_grace_s"]
