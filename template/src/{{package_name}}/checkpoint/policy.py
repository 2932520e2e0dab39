"""The save policy: when to save, one save at a time, and what to do when saves fail.

The trainer makes one call per step, ``maybe_save(step, boundary)``. A save is due every
``checkpoint.interval_steps`` steps and at the last step. Before a due save starts, the
previous one is finished (the staging buffers are reused), unless a stop is requested
meanwhile; then all ranks vote at the step boundary, so that no save starts after a
stop request and every rank decides alike.

Every wait is bounded and shared: the ranks wait for a save in flight together, and give
it up together when it fails on any rank or outlasts ``checkpoint.wait_timeout_s``.
After a background save has failed on any rank (e.g. DCP's checkpoint process died: it
is never restarted), every later save is written synchronously: slower, but checkpoints
keep coming. Saves failing ``checkpoint.max_failed_saves`` times in a row (once, with
``checkpoint.on_error: stop``) stop training with exit status 73: its state is not saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..metrics import Event, MetricsLog
from .layout import Committed
from .manager import CheckpointManager, SaveResult

WAIT_SLICE_S = 0.1  # how often a wait for the previous save looks for a stop request


@dataclass(frozen=True)
class Vote:
    """What all ranks agreed at a step boundary."""

    stop_at: float | None   # wall time of the earliest stop request on any rank, or None
    failed_saves: int       # the most failed saves on any rank, this run


@dataclass(frozen=True)
class SavesFailing:
    """Training must stop: saves keep failing and the state is not being saved."""

    failures: int
    reason: str


class StepBoundary(Protocol):
    """The stop protocol as the save policy sees it (stop.StopCoordinator)."""

    @property
    def requested(self) -> bool: ...

    def vote(self, failed_saves: int = 0) -> Vote: ...

    def any_rank(self, *flags: bool) -> tuple[bool, ...]: ...


class SavePolicy:
    def __init__(self, manager: CheckpointManager, *, interval_steps: int, final_step: int,
                 state: Callable[[], dict[str, Stateful]], record: Callable[[], dict[str, Any]],
                 metrics: MetricsLog, wait_timeout_s: float, max_failed_in_a_row: int) -> None:
        self.manager = manager
        self.interval_steps = interval_steps
        self.final_step = final_step
        self.wait_timeout_s = wait_timeout_s
        self.max_failed_in_a_row = max_failed_in_a_row
        self.failed_in_a_row = 0
        self._failures_seen = 0
        self._state = state
        self._record = record
        self.metrics = metrics
        self.synchronous = False
        self.resumed_from: Committed | None = None
        self._waited_s: dict[int, float] = {}
        self._prestage = False   # allocate the staging buffers after the first optimizer step

    # ------------------------------------------------------------ each step --
    def due(self, step: int) -> bool:
        return step == self.final_step or step % self.interval_steps == 0

    def warm_up(self, boundary: StepBoundary, timeout_s: float, *, stage: bool,
                process_log: str | None = None) -> None:
        """Start the background checkpoint process before the first step (all ranks).

        ``stage`` also allocates the staging buffers, from the state as it is: only once
        the optimizer has state (after a resume), since asking an optimizer without state
        for its state dict initialises it with a step of its own.
        """
        began = time.perf_counter()
        failure = self.manager.warm_up(self._state() if stage else None, timeout_s,
                                       process_log)
        (failed_somewhere,) = boundary.any_rank(failure is not None)
        if failed_somewhere:
            self._go_synchronous(self.progress_step(), "the background checkpoint process did "
                                 f"not start on every rank ({failure or 'on another rank'})")
        elif self.manager.mode.value != "sync":
            self._prestage = not stage
            self.metrics.say(f"background checkpointing ready in "
                             f"{time.perf_counter() - began:.2f} s")

    def progress_step(self) -> int:
        return int(self._state()["progress"].step)

    def maybe_save(self, step: int, boundary: StepBoundary) -> float | SavesFailing | None:
        """Commit what has finished, vote, and start a save if one is due.

        Returns the agreed stop time when the loop must stop for a stop request, a
        SavesFailing when saves keep failing, else None (no save was started on a stop).
        """
        self._report(self.manager.poll())
        due = self.due(step)
        if self._prestage and not due and not self.synchronous:
            # The optimizer has state now: the staging buffers are allocated in the
            # background during the next step, not by the first save.
            self._prestage = False
            self.manager.prestage(self._state())
        waited = self._finish_previous(boundary) if due else 0.0
        vote = boundary.vote(failed_saves=self.manager.failed_saves)
        if vote.stop_at is not None:
            return vote.stop_at
        if not due:
            return None
        if vote.failed_saves > self._failures_seen:  # a save failed since the last due step
            self._failures_seen = vote.failed_saves
            self.failed_in_a_row += 1
            if self.failed_in_a_row >= self.max_failed_in_a_row:
                return SavesFailing(self.failed_in_a_row, self.manager.last_error or
                                    "see the log of the rank where it failed")
            if not self.synchronous:
                self._go_synchronous(step, "a background save failed")
        else:
            self.failed_in_a_row = 0
        self._waited_s[step] = waited
        reason = "final" if step == self.final_step else "interval"
        try:
            self._report(self.manager.save(step, self._state(), reason, self._record(),
                                           blocking=self.synchronous))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - counted, voted next time
            self.manager.record_failure(step, exc, "failed")
        return None

    def _go_synchronous(self, step: int, why: str) -> None:
        self.synchronous = True
        self.metrics.say(f"{why}: saving synchronously from now on")
        self.metrics.event(Event.save_mode_changed, step=step, mode="sync", reason=why)

    def before_optimizer_step(self) -> None:
        """The staged copy of an in-flight save must be complete before weights change."""
        self.manager.wait_staged()

    def _finish_previous(self, boundary: StepBoundary, *, stop_ends_wait: bool = True) -> float:
        """Wait, on every rank together, for the save in flight (one at a time).

        The wait ends when the save is written on every rank; when a stop is requested
        on any rank (the stop then drains it within the grace period); or, giving the
        save up on every rank, when it failed on any rank or outlasted
        ``checkpoint.wait_timeout_s``. Returns the seconds waited, time on the training path.
        """
        began = time.perf_counter()
        failures_before = self.manager.failed_saves
        while True:
            if self.manager.in_flight:
                try:
                    self._report(self.manager.wait(timeout=WAIT_SLICE_S))
                except TimeoutError:
                    pass
            waited = time.perf_counter() - began
            pending, stop, failed, too_long = boundary.any_rank(
                self.manager.in_flight, stop_ends_wait and boundary.requested,
                self.manager.failed_saves > failures_before, waited > self.wait_timeout_s)
            if not pending or stop:
                return waited
            if failed or too_long:
                why = (f"it was not written within {self.wait_timeout_s:g} s "
                       "(checkpoint.wait_timeout_s)" if too_long else "it failed on another rank")
                self.manager.abandon(why)
                return waited

    def finish(self, boundary: StepBoundary) -> None:
        """At the end of the run: commit the save in flight (bounded) and release the buffers."""
        self._finish_previous(boundary, stop_ends_wait=False)
        self._report(self.manager.close())

    def committed(self, step: int) -> bool:
        """Whether ``step`` is the newest committed checkpoint (rank 0 knows)."""
        return self.newest_step == step

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
        self.metrics.event(Event.save, step=result.step, reason=result.reason, mode=result.mode,
                           blocking_s=result.blocking_s, waited_s=waited,
                           commit_latency_s=result.commit_latency_s, write_s=result.write_s,
                           path=result.path, removed=result.removed)
        self.metrics.say(f"checkpoint step {result.step} committed ({result.reason}, "
                         f"{result.mode}): blocking {result.blocking_s:.3f} s, committed "
                         f"{result.commit_latency_s:.2f} s after the save began")
