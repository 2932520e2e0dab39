"""The training loop: build from the task, resume, then step, save when due, stop when asked.

Data flows one way: the trainer builds the model, data, loss and optimizer from the
user's task (task.py, through ``task_contract``), owns the data position and RNG, and
hands the state to the save policy once per step. When to save lives in
``checkpoint.policy``; how to stop in ``stop``. Nothing below the trainer calls back up.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils.data import DataLoader

from .checkpoint import CheckpointManager, Committed, compat
from .checkpoint.policy import SavePolicy, SavesFailing
from .checkpoint.state import Progress, RankRNG, training_state
from .config import Config, OnSaveError, to_plain_dict
from .distributed import Runtime, set_gradient_sync, to_device, wrap_model
from .exits import error_line
from .metrics import Event, MetricsLog
from .sampling import GlobalBatchSampler, RankMicroBatches, split_global_batch
from .stop import StopCoordinator
from .stragglers import StragglerCheck
from .task_contract import Task, default_optimizer, lr_factor
from .watchdog import StepWatchdog

# Names the harness writes in every step event; a task's metrics may not reuse them.
STEP_FIELDS = ("event", "time", "step", "loss", "grad_norm", "lr", "step_time_s",
               "samples_per_s")
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class TaskError(RuntimeError):
    """The task broke its contract (docs/EXTENDING.md); the message says how."""


class IncompatibleCheckpoint(ValueError):
    """The newest checkpoint was saved from another model; the message lists what differs."""


class CheckpointUnusable(RuntimeError):
    """No checkpoint in checkpoint.dir can be loaded (or, strictly, not the newest)."""


@dataclass(frozen=True)
class Outcome:
    status: str                     # "finished", "preempted", "interrupted" or "not_saved"
    step: int
    detail: str = ""                # for "not_saved": why the last state is not committed


def rank_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible seed for each (run seed, step, rank)."""
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63)


def _ignore_preemption_signals(_worker_id: int) -> None:
    # DataLoader workers share the trainer's process group: a signal sent to it must
    # reach the trainer's stop path, not kill the workers first.
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _end_workers_at_exit(loader_iter: weakref.ref) -> None:
    """End a DataLoader's workers before multiprocessing's exit handler joins them.

    They ignore SIGTERM, so the loader's own last resort (``terminate``) cannot end one;
    after a crash, whose traceback keeps the loader alive until exit, the process would
    wait for them forever. Registered with atexit, which runs it before that join.
    """
    it = loader_iter()
    if it is None:
        return
    with contextlib.suppress(Exception):
        it._shutdown_workers()  # the loader's own orderly stop
    for worker in getattr(it, "_workers", ()):
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


class Trainer:
    def __init__(self, cfg: Config, task: Task, runtime: Runtime, manager: CheckpointManager,
                 stop: StopCoordinator, metrics: MetricsLog) -> None:
        self.cfg, self.task, self.runtime = cfg, task, runtime
        self.stop, self.metrics = stop, metrics
        train = cfg.train
        # Refuse a world size that cannot keep the global batch before anything is built.
        self.split = split_global_batch(train.global_batch_size, train.micro_batch_size,
                                        runtime.world_size)
        torch.manual_seed(train.seed)  # identical initial weights on every rank
        model = task.build_model(cfg)
        self.model = wrap_model(model, task.shard_units(model), cfg, runtime)
        self.optimizer, self.scheduler = task.build_optimizer(self.model, cfg)
        self.dataset = task.build_data(cfg)
        self.sampler = GlobalBatchSampler(len(self.dataset), train.global_batch_size, train.seed)
        self.progress = Progress()
        ckpt = cfg.checkpoint
        self.saves = SavePolicy(
            manager, interval_steps=ckpt.interval_steps, final_step=train.max_steps,
            state=self.state, record=self._commit_record, metrics=metrics,
            wait_timeout_s=ckpt.wait_timeout_s,
            max_failed_in_a_row=1 if ckpt.on_error == OnSaveError.stop else ckpt.max_failed_saves)
        self.stragglers = StragglerCheck(every_steps=cfg.recovery.straggler_every_steps,
                                         ratio=cfg.recovery.straggler_ratio, runtime=runtime,
                                         metrics=metrics)
        self.watchdog: StepWatchdog | None = None         # set by train.py
        self.on_first_step: Callable[[int], None] | None = None
        torch.manual_seed(rank_seed(train.seed, 0, runtime.rank))

    # ------------------------------------------------------------ checkpoint --
    def state(self, *, with_rng: bool = True) -> dict[str, Any]:
        rng = RankRNG(self.runtime.rank, self.runtime.device) if with_rng else None
        return training_state(self.model, self.optimizer, self.scheduler, self.progress, rng)

    def resume(self, manager: CheckpointManager) -> Committed | None:
        """Load the newest checkpoint that loads; fall back to older ones, with a warning.

        Every rank loads the same one (rank 0 picks it). A checkpoint of another model is
        refused (IncompatibleCheckpoint, exit status 2) with what differs. One that fails to
        load for another reason (damage the checksums could not see, an unsafe
        ``.metadata``) is skipped for the one before it, unless ``checkpoint.strict_resume``.
        """
        shapes = {k: tuple(v.shape) for k, v in get_model_state_dict(self.model).items()}
        candidates = manager.candidates() if self.runtime.is_main else iter(())
        failures: list[str] = []
        while True:
            pick: list = [None, [], None]  # checkpoint, what differs, why it is unreadable
            if self.runtime.is_main:
                pick[0] = next(candidates, None)
                if pick[0] is not None:
                    try:
                        pick[1] = compat.differences(
                            compat.saved_model_shapes(manager.storage, pick[0].name), shapes,
                            pick[0].record.get("config", {}).get("model"), self.cfg.model)
                    except (OSError, RuntimeError) as exc:  # incl. UnsafeCheckpointError
                        pick[2] = str(exc)
            if self.runtime.world_size > 1:
                dist.broadcast_object_list(pick, src=0)  # every rank loads the same one
            checkpoint, differences, unreadable = pick
            if checkpoint is None:
                if failures:
                    raise CheckpointUnusable(
                        f"no checkpoint in {manager.storage} could be loaded "
                        f"({'; '.join(failures)}); move them away or use another checkpoint.dir")
                return None
            if differences:
                raise IncompatibleCheckpoint(
                    f"checkpoint {checkpoint.path} was saved from another model: "
                    + "; ".join(differences) + ". Restore the model: settings it was trained "
                    "with (its commit.json has them) or use another checkpoint.dir")
            error = unreadable or self._load(manager, checkpoint)
            (failed,) = self.stop.any_rank(error is not None)
            if not failed:
                self.saves.resumed_from = checkpoint
                self._warn_if_schedule_changed(checkpoint)
                return checkpoint
            why = f"{checkpoint.path}: {error or 'failed on another rank'}"
            if self.cfg.checkpoint.strict_resume:
                raise CheckpointUnusable(f"cannot load checkpoint {why} (checkpoint.strict_resume "
                                         "is on, so older checkpoints are not tried)")
            self.metrics.say(f"warning: cannot load checkpoint {why}; trying the one before it")
            failures.append(why)

    def _warn_if_schedule_changed(self, checkpoint: Committed) -> None:
        """The default schedule is a function of train.max_steps: changing it on resume
        redraws the learning rate from the next step on. Say so, with both values."""
        saved = checkpoint.record.get("config", {}).get("train", {})
        train = self.cfg.train
        if (self.task.build_optimizer is not default_optimizer
                or saved.get("max_steps") in (None, train.max_steps)):
            return
        step = self.progress.step
        before = train.lr * lr_factor(step, saved.get("warmup_steps", train.warmup_steps),
                                      saved["max_steps"],
                                      saved.get("min_lr_ratio", train.min_lr_ratio))
        after = train.lr * lr_factor(step, train.warmup_steps, train.max_steps,
                                     train.min_lr_ratio)
        self.metrics.say(
            f"warning: train.max_steps is {train.max_steps}, the checkpoint's run had "
            f"{saved['max_steps']}: the learning-rate schedule is redrawn, at step {step + 1} "
            f"the learning rate is {after:.3g} instead of {before:.3g}. To continue the saved "
            f"run exactly, keep train.max_steps={saved['max_steps']}")

    def _load(self, manager: CheckpointManager, checkpoint: Committed) -> str | None:
        """Load one checkpoint into this run's state; returns why it failed, or None."""
        # RNG streams belong to ranks on one kind of device: they only carry over when
        # the ranks and the device kind do (a CPU save holds no CUDA generator state).
        saved_device = checkpoint.record.get("device_type", "cpu")
        same_streams = (checkpoint.world_size == self.runtime.world_size
                        and saved_device == self.runtime.device.type)
        try:
            manager.load(self.state(with_rng=same_streams), checkpoint)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the caller falls back
            return error_line(exc, limit=None)
        if not same_streams:
            torch.manual_seed(rank_seed(self.cfg.train.seed, self.progress.step,
                                        self.runtime.rank))
            self.metrics.say(
                f"notice: checkpoint saved on {checkpoint.world_size} {saved_device} rank(s), "
                f"resuming on {self.runtime.world_size} {self.runtime.device.type} rank(s): "
                "random streams reseeded from (seed, step, rank)")
        return None

    def _commit_record(self) -> dict[str, Any]:
        return {
            "world_size": self.runtime.world_size,
            "device_type": self.runtime.device.type,
            "global_batch_size": self.split.global_batch_size,
            "micro_batch_size": self.split.micro_batch_size,
            "grad_accum_steps": self.split.grad_accum_steps,
            "samples_consumed": self.progress.samples_consumed,
            "config": to_plain_dict(self.cfg),
        }

    # ------------------------------------------------------------------ data --
    def _micro_batches(self) -> Iterator[Any]:
        """This rank's micro-batches from the current data position on, collated."""
        workers = int(self.cfg.data.get("num_workers", 0))
        loader = DataLoader(
            self.dataset, collate_fn=self.task.collate, num_workers=workers,
            batch_sampler=RankMicroBatches(self.sampler, self.split, self.runtime.rank,
                                           self.progress.samples_consumed),
            pin_memory=self.runtime.device.type == "cuda",
            # A generator of its own: the loader draws its workers' base seed from it, and
            # a draw from the default generator would shift the saved random streams.
            generator=torch.Generator().manual_seed(rank_seed(self.cfg.train.seed,
                                                              self.progress.step,
                                                              self.runtime.rank)),
            worker_init_fn=_ignore_preemption_signals if workers else None,
            # Each worker keeps this many micro-batches ready (DataLoader refuses it
            # without workers).
            prefetch_factor=int(self.cfg.data.get("prefetch_factor", 2)) if workers else None,
            persistent_workers=workers > 0)
        batches = iter(loader)
        if workers:
            atexit.register(_end_workers_at_exit, weakref.ref(batches))
        return batches

    # ------------------------------------------------------------------ step --
    def train_step(self, batches: Iterator[Any]) -> dict[str, float]:
        """One optimizer step over the global batch; returns its loss, grad norm and metrics.

        The loss and every metric are averaged over the global batch (micro-batches and
        ranks hold equal numbers of samples).
        """
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
        self.saves.before_optimizer_step()
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
        clash = sorted(set(metrics) & set(STEP_FIELDS))
        if clash:
            raise TaskError(f"loss_and_metrics returned metric(s) {clash}: these names are "
                            f"the harness's own ({', '.join(STEP_FIELDS)}); rename them")
        return metrics

    # ------------------------------------------------------------------ loop --
    def run(self) -> Outcome:
        max_steps = self.cfg.train.max_steps
        batches = self._micro_batches()
        self.saves.warm_up(self.stop, self.cfg.checkpoint.start_timeout_s,
                           stage=bool(self.optimizer.state),
                           process_log=os.path.join(self.cfg.log.dir, "checkpoint-process."
                                                    f"rank{self.runtime.rank}.log"))
        rate = None  # samples/s, smoothed
        started = time.monotonic()
        # A request that came during start-up (building, resuming) stops before step one.
        stop = self.stop.vote().stop_at
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.start(self.progress.step)
        try:
            while stop is None and self.progress.step < max_steps:
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
                # A save has bounds of its own (checkpoint.*): the watchdog allows for them.
                with (watchdog.allow(self._save_allowance_s())
                      if watchdog is not None and self.saves.due(step)
                      else contextlib.nullcontext()):
                    stop = self.saves.maybe_save(step, self.stop)
                if stop is None and (step % self.cfg.log.every_steps == 0 or step == max_steps):
                    self._progress_line(values, rate, time.monotonic() - started)
        finally:
            if watchdog is not None:
                watchdog.stop()   # stopping and finishing have bounds of their own
        stopped = None
        if isinstance(stop, float):
            stopped = self.stop.stop(self.saves, self.progress.step, stop)
        self.saves.finish(self.stop)
        step = self.progress.step
        if isinstance(stop, SavesFailing):
            return Outcome("not_saved", step, f"{stop.failures} save(s) in a row failed, the "
                           f"last: {stop.reason}")
        if stopped is not None:
            return Outcome("interrupted" if stopped.by_user else "preempted", step)
        if not self.stop.from_rank0(self.saves.committed(step)):
            return Outcome("not_saved", step, f"the final checkpoint of step {step} did not "
                           f"commit ({self.saves.manager.last_error or 'see the log'})")
        return Outcome("finished", step)

    def _save_allowance_s(self) -> float:
        """How much longer than a step the watchdog allows the step that saves: the wait
        for the previous save (checkpoint.wait_timeout_s) and four times the newest
        measured write (before any: recovery.first_step_timeout_s)."""
        estimate = self.saves.save_estimate_s()
        return self.cfg.checkpoint.wait_timeout_s + (
            4 * estimate if estimate > 0 else self.cfg.recovery.first_step_timeout_s)

    def _progress_line(self, values: dict[str, float], samples_per_s: float,
                       elapsed_s: float) -> None:
        extra = "".join(f" | {name} {value:.4g}" for name, value in values.items()
                        if name not in ("loss", "grad_norm"))
        left = self.cfg.train.max_steps - self.progress.step
        eta_s = left * self.split.global_batch_size / samples_per_s
        self.metrics.say(f"step {self.progress.step}/{self.cfg.train.max_steps} | "
                         f"loss {values['loss']:.4f}{extra} | {samples_per_s:,.1f} samples/s | "
                         f"{_clock(elapsed_s)} elapsed, ETA {_clock(eta_s)} | "
                         f"{self.saves.describe_newest()}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
