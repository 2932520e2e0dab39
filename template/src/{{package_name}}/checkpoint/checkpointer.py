"""The checkpointer: the training loop's one checkpoint object.

The loop calls it as torchtitan's trainer calls its own; every checkpoint decision is
made here or below, alike on every rank:

    checkpointer = Checkpointer.open(cfg, runtime, metrics, stop)   # storage, lease
    resumed = checkpointer.load(trainer)          # choose, check and load; None: fresh
    checkpointer.maybe_wait_for_staging()         # each step, before the optimizer step
    decision = checkpointer.at_step_end(step, last_step=...)   # each step: save? stop?
    outcome = checkpointer.close(step, decision)  # finish the save in flight, verdict
    checkpointer.release()                        # the lease; whether a save was abandoned
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import Config, OnSaveError
from ..runtime import exit_codes
from ..runtime.distributed import Runtime, decide_on_rank0
from ..runtime.exit_codes import Refused
from ..runtime.metrics import MetricsLog
from .final_save import StepBoundary
from .load.restore import TrainingState, choose_and_load
from .policy import SavePolicy, StepDecision
from .save.pipeline import SavePipeline
from .store.errors import StorageError, StorageUnavailable
from .store.layout import BestRule, Committed, check_storage, newest_complete_checkpoint
from .store.lease import Lease, LeaseHeld
from .store.storage import Storage, open_storage

if TYPE_CHECKING:   # the memory tier is rendered on request (copier answer memory_tier)
    from .memory.tier import MemoryTier

__all__ = ["CheckpointRefused", "Checkpointer", "StepDecision", "TrainingState"]


class CheckpointRefused(Refused, RuntimeError):
    """checkpoint.dir is unusable or its lease held (``status`` 2), or the storage stayed
    unreachable for checkpoint.storage_retry_s (73: run again). A one-sentence message."""


class Checkpointer:
    def __init__(self, cfg: Config, runtime: Runtime, metrics: MetricsLog,
                 boundary: StepBoundary, pipeline: SavePipeline, lease: Lease | None,
                 newest_step: int | None,
                 allow: Callable[[float], contextlib.AbstractContextManager] | None,
                 memory: MemoryTier | None = None) -> None:
        self.cfg, self.runtime, self.metrics = cfg, runtime, metrics
        self.boundary, self.pipeline, self.lease = boundary, pipeline, lease
        self.memory = memory   # the memory tier (checkpoint.memory_interval_steps), or None
        self.first_start = newest_step is None   # no committed checkpoint at the start
        self._newest_step = newest_step
        self._training: TrainingState | None = None
        self._allow = allow
        self._policy: SavePolicy | None = None
        self._start_step, self._warm = 0, False

    @classmethod
    def open(cls, cfg: Config, runtime: Runtime, metrics: MetricsLog, boundary: StepBoundary,
             *, allow: Callable[[float], contextlib.AbstractContextManager] | None = None,
             continues: bool = False) -> Checkpointer:
        """Probe checkpoint.dir, take its lease, clean it, open the memory tier (its copies
        kept only when the start ``continues`` a run); CheckpointRefused on every rank.
        ``allow(seconds)`` widens the step watchdog's bound (StepWatchdog.allow)."""
        ckpt = cfg.checkpoint
        storage = open_storage(ckpt.dir)
        try:  # before the lease and the model: a full or read-only checkpoint.dir fails now
            check_storage(storage, ckpt.keep_last + ckpt.keep_best, ckpt.storage_retry_s)
        except StorageUnavailable as exc:
            raise CheckpointRefused(f"{exc}; run again once it is back",
                                    exit_codes.NOT_SAVED) from None
        except StorageError as exc:
            raise CheckpointRefused(str(exc)) from None
        lease = (Lease(storage, stale_s=ckpt.lease_stale_s, wait_s=ckpt.lease_wait_s)
                 if runtime.is_main else None)
        if (refused := decide_on_rank0(lambda: _take(lease))) is not None:
            raise CheckpointRefused(refused)
        pipeline = SavePipeline(storage, mode=ckpt.async_mode, keep_last=ckpt.keep_last,
                                    is_coordinator=runtime.is_main, device=runtime.device,
                                    lease=lease, verify=ckpt.verify,
                                    best=BestRule(ckpt.keep_best, ckpt.best_metric, ckpt.best_mode))
        try:
            pipeline.prepare()
            newest = decide_on_rank0(lambda: _newest_step(pipeline))
            memory = _open_memory_tier(cfg, runtime, metrics, continues)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return cls(cfg, runtime, metrics, boundary, pipeline, lease, newest, allow, memory)

    def load(self, training: TrainingState) -> Committed | None:
        """Load the newest checkpoint that loads into ``training`` (else older ones), or
        None; IncompatibleCheckpoint or CheckpointUnusable (exit 2). Saves then use it."""
        self._training = training
        resumed = None
        if self.memory is not None:   # the nearest copy: memory when not older than durable
            resumed = self.memory.restore(training.state(), self._newest_step)
        if resumed is None:
            resumed = choose_and_load(self.pipeline.storage, self.pipeline.verify, training,
                                      self.cfg, self.runtime, self.metrics)
        ckpt = self.cfg.checkpoint
        stop_at_once = ckpt.on_error == OnSaveError.stop   # the first failed save stops
        self._policy = SavePolicy(
            self.pipeline, interval_steps=ckpt.interval_steps, final_step=self.cfg.train.max_steps,
            state=training.state, record=training.commit_record, metrics=self.metrics,
            wait_timeout_s=ckpt.wait_timeout_s,
            max_failed_in_a_row=1 if stop_at_once else ckpt.max_failed_saves,
            max_failed_s=0.0 if stop_at_once else ckpt.max_failed_saves_s,
            allowance=self._allowance)
        self._policy.resumed_from = resumed
        self._start_step = training.progress.step
        return resumed

    @property
    def storage(self) -> Storage:
        """checkpoint.dir (the no-progress guard keeps its count there)."""
        return self.pipeline.storage

    def newest_recoverable_step(self) -> int | None:
        """At the start, on rank 0: the newest committed step, or a newer memory copy of
        rank 0's state (the no-progress guard compares it across starts)."""
        memory = self.memory.newest_own_step() if self.memory is not None else None
        return max([s for s in (self._newest_step, memory) if s is not None], default=None)

    def maybe_wait_for_staging(self) -> None:
        """Before the optimizer step: the staged copy of a save in flight is complete."""
        self._saves().pipeline.wait_staged()

    def at_step_end(self, step: int, *, last_step: bool = False) -> StepDecision:
        """After ``step``: commit what finished, vote, then save, stop (saving if the grace
        allows) or go on. The call before the first step starts the background checkpoint
        process and only votes. (torchtitan's ``save(step, last_step)``.)"""
        policy = self._saves()
        if not self._warm:
            self._warm = True
            timeout_s = self.cfg.checkpoint.start_timeout_s
            with self._allow(timeout_s) if self._allow else contextlib.nullcontext():
                policy.warm_up(timeout_s, stage=policy.resumed_from is not None,
                               process_log=os.path.join(self.cfg.log.dir, "checkpoint-process."
                                                        f"rank{self.runtime.rank}.log"))
        trained = step != self._start_step
        decision = policy.decide(step, self.boundary, trained=trained, last_step=last_step)
        if (self.memory is not None and trained and not decision.stop and not last_step
                and self.memory.due(step) and self._training is not None):
            self.memory.save(step, self._training.state(), self._training.commit_record())
        return dataclasses.replace(decision, newest=policy.describe_newest())

    def close(self, step: int, last: StepDecision) -> StepDecision:
        """Finish the save in flight (bounded), free its buffers; the verdict: ``last`` if
        the loop stopped, else "finished" if ``step`` is committed, else "not_saved"."""
        policy = self._saves()
        with self._allowance(False):
            policy.finish(self.boundary)
        newest = "none" if policy.newest_step is None else f"step {policy.newest_step}"
        committed = decide_on_rank0(lambda: policy.newest_step == step)  # rank 0 knows
        if self.memory is not None:   # freed once the final state is durable
            self.memory.close(free_copies=committed)
        if last.stop:
            if last.why != "not_saved":
                return last
            return dataclasses.replace(
                last, detail=f"{last.detail}; the newest committed checkpoint is {newest}")
        if committed:
            return StepDecision(saved=last.saved, why="finished")
        return StepDecision(why="not_saved", detail=(
            f"the final checkpoint of step {step} did not commit "
            f"({self.pipeline.last_error or 'see the log'}); the newest committed checkpoint "
            f"is {newest}"))

    def release(self) -> bool:
        """Give up the lease; whether an abandoned save may still run (exit without waiting)."""
        if self.lease is not None:
            self.lease.release()
        return self.pipeline.abandoned

    # ------------------ for bench (sets the interval, waits outside its timed phases) --
    def set_interval(self, steps: int) -> None:
        self._saves().interval_steps = steps

    def save_due(self, step: int) -> bool:
        return self._saves().due(step)

    def wait_until_ready(self, step: int) -> None:
        """Wait until the background checkpoint process is up (or saves go synchronous)."""
        self._saves().wait_ready(step)

    @property
    def save_in_flight(self) -> bool:
        return self.pipeline.in_flight

    def wait_for_save(self) -> None:
        self.pipeline.wait()

    @property
    def synchronous(self) -> bool:
        """Whether saves are synchronous (async_mode sync, a failed background save, no process)."""
        return self._saves().synchronous

    @property
    def failed_saves(self) -> int:
        return self.pipeline.failed_saves

    @property
    def policy(self) -> SavePolicy:
        """The save decisions (the benchmark sets their interval; training never does)."""
        return self._saves()

    def _saves(self) -> SavePolicy:
        if self._policy is None:
            raise RuntimeError("Checkpointer.load must come before the first step")
        return self._policy

    def _allowance(self, at_stop: bool) -> contextlib.AbstractContextManager:
        """The watchdog's extra time: checkpoint.wait_timeout_s (a save) or the grace
        period (a stop), plus 4x the newest write (before any: first_step_timeout_s)."""
        if self._allow is None:
            return contextlib.nullcontext()
        estimate = self._saves().save_estimate_s()
        bound = self.boundary.grace_period_s if at_stop else self.cfg.checkpoint.wait_timeout_s
        return self._allow(bound + (4 * estimate if estimate > 0
                                    else self.cfg.recovery.first_step_timeout_s))


def _take(lease: Lease | None) -> str | None:
    """Rank 0 takes the lease and starts its heartbeat; why not, or None."""
    if lease is None:
        return None
    try:
        notice = lease.acquire()
    except LeaseHeld as exc:
        return str(exc)
    if notice:
        print(f"notice: {notice}", flush=True)
    lease.start_heartbeat()
    return None


def _newest_step(pipeline: SavePipeline) -> int | None:
    newest = newest_complete_checkpoint(pipeline.storage, verify="none")
    return newest.step if newest is not None else None


def _open_memory_tier(cfg: Config, runtime: Runtime, metrics: MetricsLog,
                      continues: bool) -> MemoryTier | None:
    """The memory tier, when checkpoint.memory_interval_steps is set (the config refuses
    that unless memory_tier rendered it: config/parts.py)."""
    if not cfg.checkpoint.memory_interval_steps:
        return None
    from .memory.tier import MemoryTier, MemoryTierUnusable
    try:
        return MemoryTier.open(cfg, runtime, metrics, continues=continues)
    except MemoryTierUnusable as exc:
        raise CheckpointRefused(str(exc)) from None
