"""The step watchdog: a rank whose step does not finish in time shows where it is stuck,
then exits so that torchrun restarts the workers in place.

On a hang: every thread's stack to stderr, ``on_hang`` (the ``hang`` event, the exit
record), exit 124 (``exit_codes.HUNG``). The bounds: docs/RECOVERY.md, "Hung ranks: the
step watchdog"; a step that starts a save widens it (``allow``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from ..runtime.exit_codes import HUNG

AUTO_MIN_S = 60.0          # the automatic bound is never shorter
AUTO_FACTOR = 10.0         # times the median step time
AUTO_AFTER_STEPS = 20      # steps measured before the automatic bound applies
WINDOW_STEPS = 200         # the step times the median is taken over


class StepWatchdog:
    def __init__(self, *, rank: int, step_timeout_s: float, first_step_timeout_s: float,
                 on_hang: Callable[[int | None, float, float], None] | None = None,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.rank = rank
        self.step_timeout_s = step_timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self.on_hang = on_hang
        self._exit = exit
        self._times: deque[float] = deque(maxlen=WINDOW_STEPS)   # empty: no step finished yet
        self.step: int | None = None   # the newest step finished
        self._last = time.monotonic()
        self._deadline = math.inf
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def timeout_s(self) -> float:
        """The bound on the step now running."""
        if not self._times:
            return self.first_step_timeout_s
        if self.step_timeout_s > 0:
            return self.step_timeout_s
        if len(self._times) < AUTO_AFTER_STEPS:
            return self.first_step_timeout_s
        return max(AUTO_MIN_S, AUTO_FACTOR * statistics.median(self._times))

    def start(self, step: int) -> None:
        """Arm it before the first step of this start."""
        self.step = step
        self._rearm()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int, step_time_s: float) -> None:
        self._times.append(step_time_s)
        self.step = step
        self._rearm()

    def _rearm(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            self._deadline = self._last + self.timeout_s()

    @contextlib.contextmanager
    def allow(self, extra_s: float) -> Iterator[None]:
        """Widen the bound by ``extra_s`` while the block runs (a save with its own bounds)."""
        with self._lock:
            self._deadline = max(self._deadline, time.monotonic() + self.timeout_s() + extra_s)
        try:
            yield
        finally:
            self._rearm()

    def stop(self) -> None:
        """Disarm it (the loop ended: stopping and finishing have bounds of their own)."""
        self._stopped.set()
        with self._lock:
            self._deadline = math.inf
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while True:
            with self._lock:
                deadline, bound = self._deadline, self._deadline - self._last
            poll = max(0.05, min(1.0, bound / 20)) if math.isfinite(bound) else 1.0
            if self._stopped.wait(poll):
                return
            if time.monotonic() >= deadline:
                self._fire(bound)
                return

    def _fire(self, bound: float) -> None:
        waited = time.monotonic() - self._last
        after = f"after step {self.step}" if self._times else f"in the first step ({self.step} done)"
        sys.stdout.flush()
        sys.stderr.write(
            f"watchdog: rank {self.rank}: no step finished in {waited:.1f} s {after} (bound "
            f"{bound:.1f} s, recovery.step_timeout_s); the stack of every thread follows. "
            f"Exiting {HUNG} so that torchrun restarts the workers in place.\n")
        sys.stderr.flush()
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        sys.stderr.flush()
        if self.on_hang is not None:
            try:
                self.on_hang(self.step, waited, bound)
            except Exception as exc:  # noqa: BLE001 - the exit below matters more
                sys.stderr.write(f"watchdog: recording the hang failed: {exc}\n")
        sys.stderr.flush()
        self._exit(HUNG)
