"""The training the benchmark measures: the project's own trainer and checkpointer.

A real ``Trainer`` and ``Checkpointer`` on the scratch directory, driven step by step as
training drives them (the stop vote included), so the figures hold for training as it runs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..checkpoint import Checkpointer
from ..config import Config
from ..loop.task_contract import Task
from ..loop.trainer import Trainer
from ..preemption.stop import StopCoordinator
from ..preemption.watch import PreemptionWatch
from ..runtime.distributed import Runtime, decide_on_rank0
from ..runtime.metrics import MetricsLog

NEVER = 10**9   # an interval no step of the benchmark reaches (step numbers stay above 0)


class Bench(NamedTuple):
    trainer: Trainer
    checkpointer: Checkpointer
    batches: Iterator[Any]


def bench_config(cfg: Config, root: Path) -> Config:
    """The run's configuration, saving to the scratch directory, with no final step."""
    return replace(cfg, train=replace(cfg.train, max_steps=NEVER),
                   checkpoint=replace(cfg.checkpoint, dir=str(root), keep_last=1),
                   log=replace(cfg.log, dir=str(root / "logs")))


def build_trainer(cfg: Config, task: Task, runtime: Runtime) -> Bench:
    """Trainer and checkpointer after one step (so the optimizer state exists); the stop
    vote runs at every boundary, as in training, and always says go on."""
    metrics = MetricsLog(None)
    grace = cfg.preemption.grace_period_s
    stop = StopCoordinator(PreemptionWatch(cfg.preemption.signals), runtime, grace)
    checkpointer = Checkpointer.open(cfg, runtime, metrics, stop)
    trainer = Trainer(cfg, task, runtime, checkpointer, metrics)
    trainer.resume()                               # a fresh directory: nothing to load
    batches = trainer.micro_batches()
    checkpointer.at_step_end(0)                           # the start: the checkpoint process
    trainer.train_step(batches)
    checkpointer.wait_until_ready(0)               # up before the benchmark's own saves
    return Bench(trainer, checkpointer, batches)


def run_steps(bench: Bench, first: int, count: int) -> list[tuple[float, str]]:
    """Train ``count`` steps from ``first``, each timed from the end of the step before (the
    checkpointer's turn included); (seconds, "save" | "in_flight" | "clean") per step."""
    trainer, checkpointer = bench.trainer, bench.checkpointer
    trainer.progress.step = first - 1
    steps = []
    for step in range(first, first + count):
        began = time.perf_counter()
        was_in_flight = checkpointer.save_in_flight
        checkpointer.at_step_end(step - 1)
        trainer.train_step(bench.batches)
        kind = "save" if checkpointer.save_due(step - 1) else "in_flight" if was_in_flight else "clean"
        steps.append((time.perf_counter() - began, kind))
    return steps


def measure_stall(bench: Bench, saves: int, commit_s: float) -> dict[str, Any]:
    """Steps that start a save against steps with no save in flight, in one loop; the
    interval lets each save commit before the next is due, so no step waits on the last."""
    checkpointer = bench.checkpointer
    checkpointer.set_interval(NEVER)
    warm = run_steps(bench, 2, 3)
    step_s = decide_on_rank0(lambda: statistics.median([s for s, _ in warm[1:]]))
    # Twice the commit time measured alone: in the loop the writer shares the machine.
    interval = max(3, math.ceil(2 * commit_s / max(step_s, 1e-6)) + 2)
    checkpointer.set_interval(interval)
    steps = run_steps(bench, interval + 1, interval * saves)
    checkpointer.set_interval(NEVER)
    checkpointer.wait_for_save()
    if decide_on_rank0(lambda: not any(kind == "clean" for _, kind in steps)):
        # Every save still in flight at the next step (a busy machine): the clean steps
        # come after the last save, in the same loop (rank 0's figures decide).
        steps += run_steps(bench, interval * (saves + 1) + 1, max(3, saves))
    kinds = {kind: [s for s, k in steps if k == kind] for kind in ("save", "in_flight", "clean")}
    med = {kind: statistics.median(v) if v else None for kind, v in kinds.items()}
    stall = (med["save"] - med["clean"]) if med["save"] is not None and med["clean"] else None
    return {"stall": stall, "interval": interval, "step_s": med,
            "counts": {kind: len(v) for kind, v in kinds.items()},
            "failed_saves": checkpointer.failed_saves}


def measure_throughput(bench: Bench, steps: int, interval: int, repeats: int,
                       tokens_per_sample: int | None) -> dict[str, Any]:
    """The same steps without and with checkpointing, alternately; the median throughputs."""
    checkpointer, split = bench.checkpointer, bench.trainer.split
    rates: dict[str, list[float]] = {"without": [], "with": []}
    checkpointer.set_interval(NEVER)
    run_steps(bench, 2, 3)  # warm-up
    base = interval * 10
    saves_before = checkpointer.failed_saves
    for repeat in range(repeats):
        # without, with, with, without, ...: a machine's load changing moves both alike.
        for kind in ("without", "with") if repeat % 2 == 0 else ("with", "without"):
            checkpointer.set_interval(interval if kind == "with" else NEVER)
            # The first save comes half an interval in, so the phase holds whole saves.
            first = base + interval - interval // 2 + 1
            dist.barrier()
            began = time.perf_counter()
            run_steps(bench, first, steps)
            dist.barrier()
            elapsed = time.perf_counter() - began
            checkpointer.wait_for_save()   # the last save, if any, outside the timed phase
            dist.barrier()
            rates[kind].append(steps * split.global_batch_size / elapsed)
            base += interval * (steps // interval + 2)
    samples = {kind: statistics.median(v) for kind, v in rates.items()}
    return {
        "train_steps": steps, "interval": interval, "repeats": repeats,
        "samples_per_s": samples,
        "tokens_per_s": ({k: v * tokens_per_sample for k, v in samples.items()}
                         if tokens_per_sample else None),
        "throughput_ratio": samples["with"] / samples["without"],
        "failed_saves": checkpointer.failed_saves - saves_before,
    }


def timed(fn) -> float:
    """Seconds ``fn`` takes on every rank, its CUDA work included (a barrier on the CPU
    group does not wait for kernels still queued on the GPU)."""
    synchronize()
    dist.barrier()
    began = time.perf_counter()
    fn()
    synchronize()
    dist.barrier()
    return time.perf_counter() - began


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
