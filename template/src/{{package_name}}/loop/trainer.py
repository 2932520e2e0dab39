"""The training loop: build from the task, resume, then step, save when due, stop when asked.

The trainer builds everything from the task (through ``task_contract``), owns the data
position and RNG, and hands its state to the checkpointer once per step; when to save and
stop is decided there (``checkpoint.policy``). Nothing below the trainer calls back up.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ..checkpoint import Checkpointer, Committed
from ..checkpoint.state import Progress, RankRNG, training_state
from ..config import Config, TaskContext, to_plain_dict
from ..recovery.watchdog import StepWatchdog
from ..runtime.distributed import Runtime
from ..runtime.metrics import Event, MetricsLog
from . import loader
from .evaluate import Evaluator, eval_fields
from .parallelize import set_gradient_sync, to_device, wrap_model
from .sampling import GlobalBatchSampler, split_global_batch
from .task_contract import Task, default_optimizer

# Names the harness writes in every step event; a task's metrics may not reuse them.
STEP_FIELDS = ("event", "time", "step", "loss", "grad_norm", "lr", "step_time_s",
               "samples_per_s")


class TaskError(RuntimeError):
    """The task broke its contract (docs/EXTENDING.md); the message says how."""


@dataclass(frozen=True)
class Outcome:
    status: str                     # "finished", "preempted", "interrupted" or "not_saved"
    step: int
    detail: str = ""                # for "not_saved": why the last state is not committed


def rank_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible seed for each (run seed, step, rank)."""
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63)


class NoStragglerCheck:
    """recovery.straggler_every_steps = 0: the trainer's straggler hooks do nothing."""

    def add_input(self, seconds: float) -> None:
        pass

    def optimizer(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step_done(self, step_time_s: float) -> None:
        pass

    def due(self, step: int) -> bool:
        return False


def straggler_check(cfg: Config, runtime: Runtime, metrics: MetricsLog) -> Any:
    """The check recovery.straggler_every_steps asks for (rendered with the copier answer
    straggler_detection; without it the config refuses the setting: config/parts.py)."""
    if not cfg.recovery.straggler_every_steps:
        return NoStragglerCheck()
    from ..recovery.stragglers import StragglerCheck
    return StragglerCheck(every_steps=cfg.recovery.straggler_every_steps,
                          ratio=cfg.recovery.straggler_ratio, runtime=runtime, metrics=metrics)


class Trainer:
    def __init__(self, cfg: Config, task: Task, runtime: Runtime, checkpointer: Checkpointer,
                 metrics: MetricsLog, watchdog: StepWatchdog | None = None,
                 stop_requested: Callable[[], bool] = lambda: False) -> None:
        self.cfg, self.task, self.runtime = cfg, task, runtime
        self.checkpointer, self.metrics = checkpointer, metrics
        train = cfg.train
        # Refuse a world size that cannot keep the global batch before anything is built.
        self.split = split_global_batch(train.global_batch_size, train.micro_batch_size,
                                        runtime.world_size)
        torch.manual_seed(train.seed)  # identical initial weights on every rank
        context = TaskContext(first_start=checkpointer.first_start, rank=runtime.rank,
                              world_size=runtime.world_size, device=runtime.device)
        model = task.build_model(cfg, context)
        self.model = wrap_model(model, task.shard_units(model), cfg, runtime)
        self.optimizer, self.scheduler = task.build_optimizer(self.model, cfg)
        self.uses_default_schedule = task.build_optimizer is default_optimizer
        self.dataset = task.build_data(cfg)
        self.sampler = GlobalBatchSampler(len(self.dataset), train.global_batch_size, train.seed)
        self.progress = Progress()
        self._adapters: dict[str, Any] | None = None   # built once: saves reuse them
        self.stragglers = straggler_check(cfg, runtime, metrics)
        self.watchdog = watchdog
        self.stop_requested = stop_requested   # a preemption ends an evaluation early
        self.evaluator = Evaluator(cfg, task, runtime)
        self.last_eval_step: int | None = None  # in the commit record: a resume redoes it
        self.last_eval: dict[str, float] | None = None
        self._eval_first = False
        self.on_first_step: Callable[[int], None] | None = None
        self.reseed(0)

    # ------------------------------------------------- what a checkpoint holds --
    def state(self, *, with_rng: bool = True) -> dict[str, Any]:
        """The training state a checkpoint holds (Stateful adapters, reused across saves)."""
        if self._adapters is None:
            self._adapters = training_state(self.model, self.optimizer, self.scheduler,
                                            self.progress,
                                            RankRNG(self.runtime.rank, self.runtime.device))
        adapters = self._adapters
        return adapters if with_rng else {k: v for k, v in adapters.items() if k != "rng"}

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in get_model_state_dict(self.model).items()}

    def reseed(self, step: int) -> None:
        """This rank's random streams from (seed, step, rank): a fresh start, or a resume
        whose saved streams belong to other ranks."""
        torch.manual_seed(rank_seed(self.cfg.train.seed, step, self.runtime.rank))

    def resume(self) -> Committed | None:
        """Load the newest checkpoint that loads; None: fresh. A due evaluation the saved run
        did not finish (a stop came during it) runs first."""
        resumed = self.checkpointer.load(self)
        if resumed is not None:
            self.last_eval_step = resumed.record.get("last_eval_step")
            self.last_eval = resumed.record.get("eval")
            step = self.progress.step
            self._eval_first = self.evaluator.due(step) and self.last_eval_step != step
        return resumed

    @functools.cached_property
    def _plain_config(self) -> dict[str, Any]:
        """The config as plain data, made once (OmegaConf's ~15 ms is long for frequent saves)."""
        return to_plain_dict(self.cfg)

    def commit_record(self) -> dict[str, Any]:
        return {
            "world_size": self.runtime.world_size,
            "device_type": self.runtime.device.type,
            "global_batch_size": self.split.global_batch_size,
            "micro_batch_size": self.split.micro_batch_size,
            "grad_accum_steps": self.split.grad_accum_steps,
            "samples_consumed": self.progress.samples_consumed,
            "last_eval_step": self.last_eval_step,
            "eval": self.last_eval,     # its figures (checkpoint.keep_best ranks by them)
            "config": self._plain_config,
        }

    # ------------------------------------------------------------------ data --
    def micro_batches(self) -> Iterator[Any]:
        """This rank's micro-batches from the current data position on, collated."""
        return loader.micro_batches(
            self.dataset, self.task.collate, self.sampler, self.split, self.runtime.rank,
            self.progress.samples_consumed,
            rank_seed(self.cfg.train.seed, self.progress.step, self.runtime.rank),
            self.runtime.device, self.cfg.loader)

    # ------------------------------------------------------------------ step --
    def train_step(self, batches: Iterator[Any]) -> dict[str, float]:
        """One optimizer step; its loss, grad norm and metrics, averaged over the global batch."""
        self.model.train()
        accum = self.split.grad_accum_steps
        sums: dict[str, torch.Tensor] = {}
        for i in range(accum):
            set_gradient_sync(self.model, self.cfg.distributed.parallelism, i == accum - 1)
            began = time.perf_counter()
            batch = to_device(next(batches), self.runtime.device)
            self.stragglers.add_input(time.perf_counter() - began)
            loss, metrics = self.task.loss_and_metrics(self.model, batch)
            (loss / accum).backward()
            for name, value in {"loss": loss, **self._checked(metrics)}.items():
                value = torch.as_tensor(value).detach().to(self.runtime.device, torch.float64)
                sums[name] = sums.get(name, 0) + value
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.checkpointer.maybe_wait_for_staging()
        with self.stragglers.optimizer():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        names = sorted(sums)
        totals = torch.stack([sums[name] for name in names])
        if self.runtime.world_size > 1:
            dist.all_reduce(totals)
        means = (totals / (accum * self.runtime.world_size)).tolist()
        self.progress.step += 1
        self.progress.samples_consumed += self.split.global_batch_size
        return {**dict(zip(names, means)), "grad_norm": float(grad_norm)}

    def _checked(self, metrics: Any) -> dict[str, Any]:
        if not isinstance(metrics, dict):
            raise TaskError(f"loss_and_metrics must return (loss, dict of metrics), got "
                            f"{type(metrics).__name__} as the second value")
        if clash := sorted(set(metrics) & set(STEP_FIELDS)):
            raise TaskError(f"loss_and_metrics returned metric(s) {clash}: these names are "
                            f"the harness's own ({', '.join(STEP_FIELDS)}); rename them")
        return metrics

    # ------------------------------------------------------------------ loop --
    def run(self) -> Outcome:
        """Step to ``train.max_steps``, or until the checkpointer (saving, preemption) says stop."""
        max_steps = self.cfg.train.max_steps
        batches = self.micro_batches()
        rate = None  # samples/s, smoothed
        started = time.monotonic()
        step = self.progress.step
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.start(step)
        values: dict[str, float] | None = None
        try:
            if self._eval_first:
                self._eval_first = False
                self.evaluate(step)
            while True:
                # Before the first step this only votes: a stop asked for during start-up
                # (building, resuming) ends the run before step one.
                decision = self.checkpointer.at_step_end(step, last_step=step >= max_steps)
                if values is not None and not decision.stop and (
                        step % self.cfg.log.every_steps == 0 or step == max_steps):
                    self._progress_line(values, rate, time.monotonic() - started,
                                        decision.newest)
                if decision.stop or step >= max_steps:
                    break
                began = time.perf_counter()
                values = self.train_step(batches)
                step_time = time.perf_counter() - began
                step = self.progress.step
                if watchdog is not None:
                    watchdog.beat(step, step_time)
                samples_per_s = self.split.global_batch_size / step_time
                rate = samples_per_s if rate is None else 0.8 * rate + 0.2 * samples_per_s
                self.metrics.event(Event.step, step=step, **values, step_time_s=step_time,
                                   samples_per_s=samples_per_s,
                                   lr=self.optimizer.param_groups[0]["lr"])
                if self.on_first_step is not None:
                    self.on_first_step(step)
                    self.on_first_step = None
                self.stragglers.step_done(step_time)
                if self.stragglers.due(step):
                    self.stragglers.check(step)
                if self.evaluator.due(step):
                    self.evaluate(step)
        finally:
            if watchdog is not None:
                watchdog.stop()   # finishing has bounds of its own
        verdict = self.checkpointer.close(step, decision)
        return Outcome(verdict.why, step, verdict.detail)

    def evaluate(self, step: int) -> dict[str, float] | None:
        """Evaluate the model at ``step``; log the ``eval`` event (rank 0) and return the
        means, or None when a stop request ended the evaluation early."""
        began = time.perf_counter()
        self.metrics.say(f"evaluating step {step} ({self.evaluator.samples()} samples)")
        # An evaluation is no step: the watchdog allows it the first step's bound.
        with (self.watchdog.allow(self.cfg.recovery.first_step_timeout_s)
              if self.watchdog is not None else contextlib.nullcontext()):
            means = self.evaluator.run(self.model, self.stop_requested)
        if means is None:
            self.metrics.say(f"evaluation of step {step} stopped by the stop request; a "
                             "resumed run evaluates this step first")
            return None
        fields = eval_fields(means)
        self.last_eval_step, self.last_eval = step, fields
        self.metrics.event(Event.eval, step=step, **fields,
                           eval_samples=self.evaluator.samples(),
                           eval_time_s=time.perf_counter() - began)
        self.metrics.say(f"eval step {step} | " + " | ".join(
            f"{name} {value:.4g}" for name, value in fields.items()))
        return means

    def _progress_line(self, values: dict[str, float], samples_per_s: float,
                       elapsed_s: float, newest: str) -> None:
        extra = "".join(f" | {name} {value:.4g}" for name, value in values.items()
                        if name not in ("loss", "grad_norm"))
        left = self.cfg.train.max_steps - self.progress.step
        eta_s = left * self.split.global_batch_size / samples_per_s
        self.metrics.say(f"step {self.progress.step}/{self.cfg.train.max_steps} | "
                         f"loss {values['loss']:.4f}{extra} | {samples_per_s:,.1f} samples/s | "
                         f"{_clock(elapsed_s)} elapsed, ETA {_clock(eta_s)} | "
                         f"{newest}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
