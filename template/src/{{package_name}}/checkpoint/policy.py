"""The save policy: when to save, one save at a time, and what to do when saves fail.

The trainer makes one call per step, ``maybe_save(step, boundary)``. A save is due every
``checkpoint.interval_steps`` steps and at the last step. Before a due save starts, the
previous one is finished (the staging buffers are reused), unless a stop is requested
meanwhile; then all ranks vote at the step boundary, so that no save starts after a
stop request and every rank decides alike. After a background save has failed on any
rank (e.g. DCP's checkpoint process died: it is never restarted), every later save is
written synchronously: slower, but checkpoints keep coming.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch.distributed.checkpoint.stateful import Stateful

from ..metrics import MetricsLog
from .layout import Committed
from .manager import CheckpointManager, SaveResult

WAIT_SLICE_S = 0.1  # how often a wait for the previous save looks for a stop request


@dataclass(frozen=True)
class Vote:
    """What all ranks agreed at a step boundary."""

    stop_at: float | None   # wall time of the earliest stop request on any rank, or None
    save_failed: bool       # a save has failed on some rank


class StepBoundary(Protocol):
    """The stop protocol as the save policy sees it (preemption's StopCoordinator)."""

    @property
    def requested(self) -> bool: ...

    def vote(self, save_failed: bool) -> Vote: ...


class SavePolicy:
    def __init__(self, manager: CheckpointManager, *, interval_steps: int, final_step: int,
                 state: Callable[[], dict[str, Stateful]], record: Callable[[], dict[str, Any]],
                 metrics: MetricsLog) -> None:
        self.manager = manager
        self.interval_steps = interval_steps
        self.final_step = final_step
        self._state = state
        self._record = record
        self.metrics = metrics
        self.synchronous = False
        self.resumed_from: Committed | None = None
        self._waited_s: dict[int, float] = {}

    # ------------------------------------------------------------ each step --
    def due(self, step: int) -> bool:
        return step == self.final_step or step % self.interval_steps == 0

    def maybe_save(self, step: int, boundary: StepBoundary) -> float | None:
        """Commit what has finished, vote, and start a save if one is due.

        Returns the agreed stop time when the loop must stop (no save was started), else None.
        """
        self._report(self.manager.poll())
        due = self.due(step)
        waited = self._finish_previous(boundary) if due else 0.0
        vote = boundary.vote(save_failed=self.manager.failed_saves > 0)
        if vote.stop_at is not None:
            return vote.stop_at
        if due:
            if vote.save_failed and not self.synchronous:
                self.synchronous = True
                self.metrics.say("a background save failed: saving synchronously from now on")
                self.metrics.event("save_mode_changed", step=step, mode="sync",
                                   reason="a background save failed")
            self._waited_s[step] = waited
            reason = "final" if step == self.final_step else "interval"
            self._report(self.manager.save(step, self._state(), reason, self._record(),
                                           blocking=self.synchronous))
        return None

    def before_optimizer_step(self) -> None:
        """The staged copy of an in-flight save must be complete before weights change."""
        self.manager.wait_staged()

    def _finish_previous(self, boundary: StepBoundary) -> float:
        """Wait for the save in flight (one at a time); a stop request ends the wait.

        The stop then drains that save within the grace period instead. Returns the
        seconds waited, which count as time on the training path.
        """
        began = time.perf_counter()
        while self.manager.in_flight and not boundary.requested:
            try:
                self._report(self.manager.wait(timeout=WAIT_SLICE_S))
            except TimeoutError:
                continue
        return time.perf_counter() - began

    def finish(self) -> None:
        """At the end of the run: commit the save in flight and release the buffers."""
        self._report(self.manager.close())

    # -------------------------------------------------------- for the stop --
    @property
    def in_flight_step(self) -> int | None:
        return self.manager.in_flight_step

    def drain(self, timeout: float) -> tuple[SaveResult | None, bool]:
        """Commit the save in flight within ``timeout`` s: (result, whether time ran out).

        A save that does not finish in time is abandoned: its directory never counts.
        """
        try:
            result = self.manager.wait(timeout=timeout)
        except TimeoutError:
            self.manager.abandon()
            return None, True
        self._report(result)
        return result, False

    def save_now(self, step: int, reason: str) -> SaveResult | None:
        """A synchronous save of the current state (the final one before exiting)."""
        result = self.manager.save(step, self._state(), reason, self._record(), blocking=True)
        self._report(result)
        return result

    @property
    def newest_step(self) -> int | None:
        """The step a restart would resume from (rank 0 knows), or None."""
        if self.manager.last_committed is not None:
            return self.manager.last_committed.step
        return self.resumed_from.step if self.resumed_from is not None else None

    def save_estimate_s(self) -> float:
        """How long a synchronous save may take: the newest measured write time.

        This run's last commit, else the one resumed from (its commit.json), else 0
        (unknown: try anyway; a save cut off by the hard kill never counts).
        """
        if self.manager.last_committed is not None:
            return self.manager.last_committed.write_s
        if self.resumed_from is not None:
            record = self.resumed_from.record
            return float(record.get("write_s", record.get("commit_latency_s", 0.0)))
        return 0.0

    # ------------------------------------------------------------- reporting --
    def describe_newest(self) -> str:
        last = self.manager.last_committed
        if last is not None:
            return (f"last save step {last.step} (blocking {last.blocking_s:.3f} s, "
                    f"committed after {last.commit_latency_s:.2f} s)")
        if self.resumed_from is not None:
            return f"resumed from step {self.resumed_from.step}"
        return "no save yet"

    def _report(self, result: SaveResult | None) -> None:
        if result is None:
            return
        waited = self._waited_s.pop(result.step, 0.0)
        self.metrics.event("save", step=result.step, reason=result.reason, mode=result.mode,
                           blocking_s=result.blocking_s, waited_s=waited,
                           commit_latency_s=result.commit_latency_s, write_s=result.write_s,
                           path=result.path, removed=result.removed)
        self.metrics.say(f"checkpoint step {result.step} committed ({result.reason}, "
                         f"{result.mode}): blocking {result.blocking_s:.3f} s, committed "
                         f"{result.commit_latency_s:.2f} s after the save began")
