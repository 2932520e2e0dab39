"""The save decisions: when to save, one save at a time, failing saves.

``decide(step, boundary)``, once per step boundary, gives a ``StepDecision``: a save is
due every ``checkpoint.interval_steps`` steps and at the last step, once the previous one
finished; all ranks vote, so no save starts after a stop request (``final_save.py``).
Every wait is bounded and shared by the ranks; after a failed background save, saves are
synchronous; failing saves end training (``failed_saves.py``). docs/PREEMPTION.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..runtime.distributed import any_rank
from ..runtime.metrics import Event, MetricsLog
from ..runtime.phases import Phase
from . import final_save
from .failed_saves import FailedSaves
from .final_save import StepBoundary
from .save.pipeline import SavePipeline, SaveResult
from .store.layout import Committed

WAIT_SLICE_S = 0.1  # how often a wait for the previous save looks for a stop request
# A save in flight longer than OVERDUE_MIN_S and OVERDUE_FACTOR x the newest write is
# overdue: a due save no longer waits for it but is left to the next due step.
OVERDUE_MIN_S = 10.0
OVERDUE_FACTOR = 3.0


@dataclass(frozen=True)
class StepDecision:
    """What the checkpointer decided at a step boundary, the same on every rank."""

    saved: bool = False   # a save started at this step (or, at a stop, committed)
    stop: bool = False    # the loop must stop now
    why: str = ""         # "interval", "final", "preempted", "interrupted", "not_saved"
    detail: str = ""      # for "not_saved": why the state is not being saved
    newest: str = ""      # the newest checkpoint, in words (for the progress line)


class SavePolicy:
    def __init__(self, pipeline: SavePipeline, *, interval_steps: int, final_step: int,
                 state: Callable[[], dict[str, Stateful]], record: Callable[[], dict[str, Any]],
                 metrics: MetricsLog, wait_timeout_s: float, max_failed_in_a_row: int,
                 allowance: Callable[[bool], contextlib.AbstractContextManager] = (
                     lambda _at_stop: contextlib.nullcontext()),
                 max_failed_s: float = 0.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.pipeline = pipeline
        self.interval_steps = interval_steps
        self.final_step = final_step
        self.wait_timeout_s = wait_timeout_s
        self.allowance = allowance
        self.failures = FailedSaves(max_failed_in_a_row, max_failed_s, clock)
        self._state, self._record = state, record
        self.metrics = metrics
        self.synchronous = False
        self.resumed_from: Committed | None = None
        self._waited_s: dict[int, float] = {}
        self._deferred_for: int | None = None   # the late save in flight last said
        self._prestage = False   # allocate the staging buffers after the first optimizer step
        self._starting = False   # the checkpoint process is starting (``warm_up``)
        self._warm_up_began = 0.0

    def due(self, step: int) -> bool:
        return step == self.final_step or step % self.interval_steps == 0

    def warm_up(self, timeout_s: float, *, stage: bool, process_log: str | None = None) -> None:
        """Start the background checkpoint process before the first step (all ranks); the
        first steps train while it starts (``wait_ready``). ``stage`` also fills the staging
        buffers: only when the optimizer has state (after a resume), since asking one
        without state for its state dict initialises it with a step of its own."""
        self._warm_up_began = time.perf_counter()
        failure = self.pipeline.warm_up(self._state() if stage else None, timeout_s,
                                       process_log)
        (failed_somewhere,) = any_rank(failure is not None)
        if failed_somewhere:
            self._go_synchronous(int(self._state()["progress"].step), "the background "
                                 "checkpoint process did not start on every rank "
                                 f"({failure or 'on another rank'})")
        elif self.pipeline.mode.value != "sync":
            self._prestage = not stage
            self._starting = True

    def wait_ready(self, step: int) -> None:
        """Before the first save (all ranks, one step): the process is up, else saves go sync."""
        if not self._starting:
            return
        self._starting = False
        waiting = time.perf_counter()
        failure = self.pipeline.wait_ready()
        waited = time.perf_counter() - waiting   # the loop was blocked this long
        (failed_somewhere,) = any_rank(failure is not None)
        if failed_somewhere:
            self._go_synchronous(step, "the background checkpoint process did not start on "
                                 f"every rank ({failure or 'on another rank'})")
            return
        took = time.perf_counter() - self._warm_up_began
        self.metrics.event(Event.phase, step=step, phase=Phase.checkpoint_process_ready.value,
                           at=round(time.time(), 3), duration_s=round(took, 3),
                           waited_s=round(waited, 3), off_the_path=True)
        self.metrics.say(f"background checkpointing ready {took:.2f} s after it was started "
                         "(the first steps trained meanwhile)")

    def decide(self, step: int, boundary: StepBoundary, *, trained: bool = True,
               last_step: bool = False) -> StepDecision:
        """Commit what finished, vote, then stop (saving within the grace) or start a due
        save, under ``allowance(at_stop)``. ``trained``: a step was trained since the start
        (the call before the first step only votes)."""
        self._report(self.pipeline.poll())
        due = trained and (last_step or self.due(step))
        if self._prestage and not due and not self.synchronous and trained:
            # The optimizer has state now: allocate the buffers during the next step.
            self._prestage = False
            self.pipeline.prestage(self._state())
        waited, deferred = 0.0, False
        with self.allowance(False) if due else contextlib.nullcontext():
            if due:
                waited, deferred = self._finish_previous(boundary, defer=not last_step)
            vote = boundary.vote(failed_saves=self.pipeline.failed_saves)
        if due and self._starting:   # a stop saves synchronously: it needs no process
            with self.allowance(False):
                self.wait_ready(step)
        if vote.stop_at is not None:   # preemption: one more reason to save, now
            with self.allowance(True):
                stopped = final_save.stop(self, step, vote.stop_at, boundary)
            return StepDecision(saved=stopped.final_step is not None, stop=True,
                                why="interrupted" if stopped.by_user else "preempted")
        if deferred:
            self._say_deferred(step)
        if deferred or not due:
            return StepDecision()
        if self.failures.count(vote.failed_saves):  # a save failed since the last due step
            if self.failures.spent():
                last = self.pipeline.last_error or "see the log of the rank where it failed"
                return StepDecision(stop=True, why="not_saved", detail=self.failures.why(last))
            if (waiting := self.failures.waiting()) is not None:
                self.metrics.say(waiting)
            # A broken process is left for synchronous saves; unreachable storage is not.
            (broken,) = any_rank(self.pipeline.broken_save)
            self.pipeline.broken_save = False
            if broken and not self.synchronous:
                self._go_synchronous(step, "a background save failed")
        self._waited_s[step] = waited
        reason = "final" if last_step or step == self.final_step else "interval"
        try:
            with self.allowance(False):
                self._report(self.pipeline.save(step, self._state(), reason, self._record(),
                                               blocking=self.synchronous))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - counted, voted next time
            self.pipeline.record_failure(step, exc, "failed")
            return StepDecision(why=reason)
        return StepDecision(saved=True, why=reason)

    @property
    def failed_in_a_row(self) -> int:
        return self.failures.in_a_row

    def _go_synchronous(self, step: int, why: str) -> None:
        self.synchronous = True
        self.metrics.say(f"{why}: saving synchronously from now on")
        self.metrics.event(Event.save_mode_changed, step=step, mode="sync", reason=why)

    def _finish_previous(self, boundary: StepBoundary, *, stop_ends_wait: bool = True,
                         defer: bool = False) -> tuple[float, bool]:
        """Wait, on every rank together, for the save in flight: until it is written on
        every rank or a stop is requested on any; giving it up when it failed on any rank
        or outlasted ``checkpoint.wait_timeout_s`` (waited, or with ``defer`` since it
        started). With ``defer`` (a due save not the last) the save is left in flight once
        overdue. Returns the seconds waited and whether it was left so."""
        began = time.perf_counter()
        failures_before = self.pipeline.failed_saves
        overdue_s = self.overdue_after_s() if defer else float("inf")
        while True:
            age = self.pipeline.in_flight_s
            if self.pipeline.in_flight and age <= overdue_s:
                with contextlib.suppress(TimeoutError):
                    self._report(self.pipeline.wait(timeout=WAIT_SLICE_S))
            waited = time.perf_counter() - began
            pending, stop, failed, too_long, overdue = any_rank(
                self.pipeline.in_flight, stop_ends_wait and boundary.requested,
                self.pipeline.failed_saves > failures_before,
                waited > self.wait_timeout_s or (defer and age > self.wait_timeout_s),
                age > overdue_s)
            if not pending or stop:
                return waited, False
            if failed or too_long:
                why = (f"it was not written within {self.wait_timeout_s:g} s "
                       "(checkpoint.wait_timeout_s)" if too_long else "it failed on another rank")
                self.pipeline.abandon(why)
                return waited, False
            if overdue:
                return waited, True

    def overdue_after_s(self) -> float:
        """How long after its start a save in flight is waited for by a due save."""
        return max(OVERDUE_MIN_S, OVERDUE_FACTOR * self.save_estimate_s())

    def _say_deferred(self, step: int) -> None:
        """One line per save in flight that due saves stopped waiting for."""
        late = self.pipeline.in_flight_step
        if late != self._deferred_for:
            self._deferred_for = late
            self.metrics.say(
                f"the save of step {late} is still being written after "
                f"{self.pipeline.in_flight_s:.0f} s (storage slow or unreachable): training "
                f"goes on and step {step}'s save is left to the next due step (one save at a "
                f"time; it is given up after checkpoint.wait_timeout_s="
                f"{self.wait_timeout_s:g} s)")

    def finish(self, boundary: StepBoundary) -> None:
        """At the end of the run: commit the save in flight (bounded) and release the buffers."""
        if self._starting:   # stopped before any save needed the checkpoint process
            self._starting = False
            self.pipeline.give_up_start()
        self._finish_previous(boundary, stop_ends_wait=False)
        self._report(self.pipeline.close())

    # -------------------------------------------------------- for the stop --
    def drain(self, timeout: float) -> tuple[SaveResult | None, bool]:
        """Commit the save in flight within ``timeout`` s, else abandon it; (result, timed out)."""
        try:
            result = self.pipeline.wait(timeout=timeout)
        except TimeoutError:
            self.pipeline.abandon()
            return None, True
        self._report(result)
        return result, False

    def save_now(self, step: int, reason: str) -> SaveResult | None:
        """A synchronous save of the current state (the final one before exiting)."""
        result = self.pipeline.save(step, self._state(), reason, self._record(), blocking=True)
        self._report(result)
        return result

    @property
    def newest_step(self) -> int | None:
        """The step a restart would resume from (rank 0 knows), or None."""
        if self.pipeline.last_committed is not None:
            return self.pipeline.last_committed.step
        return self.resumed_from.step if self.resumed_from is not None else None

    def save_estimate_s(self) -> float:
        """How long a synchronous save may take: the newest measured write (this run's,
        else the resumed checkpoint's commit.json), else 0 (unknown: try anyway)."""
        if self.pipeline.last_committed is not None:
            return self.pipeline.last_committed.write_s
        if self.resumed_from is not None:
            record = self.resumed_from.record
            return float(record.get("write_s", record.get("commit_latency_s", 0.0)))
        return 0.0

    def describe_newest(self) -> str:
        last = self.pipeline.last_committed
        if last is not None:
            return (f"last save step {last.step} (blocking {last.blocking_s:.3f} s, "
                    f"committed after {last.commit_latency_s:.2f} s)")
        if self.resumed_from is not None:
            return f"resumed from step {self.resumed_from.step}"
        return "no save yet"

    def _report(self, result: SaveResult | None) -> None:
        if result is None:
            return
        self.failures.committed()
        waited = self._waited_s.pop(result.step, 0.0)
        self.metrics.event(Event.save, step=result.step, reason=result.reason, mode=result.mode,
                           blocking_s=result.blocking_s, waited_s=waited,
                           commit_latency_s=result.commit_latency_s, write_s=result.write_s,
                           path=result.path, removed=result.removed)
        self.metrics.say(f"checkpoint step {result.step} committed ({result.reason}, "
                         f"{result.mode}): blocking {result.blocking_s:.3f} s, committed "
                         f"{result.commit_latency_s:.2f} s after the save began")
