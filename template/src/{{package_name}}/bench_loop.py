"""The training loop the benchmark measures: the trainer's optimizer step and the save
policy, on the real model and optimizer state of a configuration (``bench`` measures the
stall and the throughput cost with it; the save-path tests drive it with a slow writer).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from .checkpoint import CheckpointManager
from .checkpoint.policy import SavePolicy, Vote
from .checkpoint.state import Progress, RankRNG, training_state
from .config import Config
from .distributed import Runtime, set_gradient_sync, to_device, wrap_model
from .metrics import MetricsLog
from .sampling import split_global_batch
from .task_contract import Task


class Built(NamedTuple):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: Progress
    state: dict[str, Stateful]


def build_state(cfg: Config, task: Task, runtime: Runtime) -> Built:
    """The model and optimizer of this configuration after one optimizer step (so that
    the optimizer state exists), and the state a checkpoint of them holds."""
    torch.manual_seed(cfg.train.seed)
    model = task.build_model(cfg)
    model = wrap_model(model, task.shard_units(model), cfg, runtime)
    optimizer, scheduler = task.build_optimizer(model, cfg)
    dataset = task.build_data(cfg)
    samples = [dataset[i % len(dataset)] for i in range(cfg.train.micro_batch_size)]
    loss, _ = task.loss_and_metrics(model, to_device(task.collate(samples), runtime.device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    progress = Progress(step=1, samples_consumed=cfg.train.global_batch_size)
    state = training_state(model, optimizer, scheduler, progress,
                           RankRNG(runtime.rank, runtime.device))
    return Built(model, optimizer, scheduler, progress, state)


# ------------------------------------------------------------- a training loop --
class Boundary:
    """The step-boundary collectives of the stop protocol (stop.StopCoordinator), with no
    stop ever asked for: the loop pays for the same all-reduces as training does."""

    requested = False

    def vote(self, failed_saves: int = 0) -> Vote:
        tensor = torch.tensor([math.inf, -float(failed_saves)], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return Vote(None, int(-float(tensor[1])))

    def any_rank(self, *flags: bool) -> tuple[bool, ...]:
        tensor = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in tensor.tolist())


class Loop:
    """The trainer's optimizer step (gradient accumulation, clipping, the staging wait
    before the optimizer step, the loss all-reduce) on a few fixed micro-batches."""

    def __init__(self, cfg: Config, task: Task, built: Built, runtime: Runtime) -> None:
        self.cfg, self.task, self.built, self.runtime = cfg, task, built, runtime
        self.split = split_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                        runtime.world_size)
        dataset = task.build_data(cfg)
        n = cfg.train.micro_batch_size
        offset = runtime.rank * n
        self.batches = itertools.cycle([
            to_device(task.collate([dataset[(offset + k * n * runtime.world_size + i)
                                            % len(dataset)] for i in range(n)]),
                      runtime.device) for k in range(4)])

    def step(self, policy: SavePolicy | None) -> None:
        model, optimizer = self.built.model, self.built.optimizer
        model.train()
        accum = self.split.grad_accum_steps
        total = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        for i in range(accum):
            set_gradient_sync(model, self.cfg.distributed.parallelism, i == accum - 1)
            loss, _ = self.task.loss_and_metrics(model, next(self.batches))
            (loss / accum).backward()
            total += loss.detach().to(torch.float64)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if policy is not None:
            policy.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.built.scheduler is not None:
            self.built.scheduler.step()
        if self.runtime.world_size > 1:
            dist.all_reduce(total)
        float(total)
        self.built.progress.step += 1
        self.built.progress.samples_consumed += self.split.global_batch_size


NEVER = 10**9   # an interval no step of the benchmark reaches (step numbers stay above 0)


def policy_for(manager: CheckpointManager, built: Built, interval: int) -> SavePolicy:
    return SavePolicy(manager, interval_steps=interval, final_step=-1,
                      state=lambda: built.state,
                      record=lambda: {"world_size": dist.get_world_size()},
                      metrics=MetricsLog(None), wait_timeout_s=600, max_failed_in_a_row=10**9)


def run_steps(loop: Loop, policy: SavePolicy, first: int, count: int) -> list[tuple[float, str]]:
    """Train ``count`` steps numbered from ``first``; time each from the end of the step
    before: the save policy's turn after that step (commit, vote, maybe a save), then
    this step, whose forward and backward pass overlap the staging copy of a save just
    started. Returns (seconds, "save" | "in_flight" | "clean") per step."""
    boundary = Boundary()
    manager = policy.manager
    steps = []
    for step in range(first, first + count):
        began = time.perf_counter()
        was_in_flight = manager.in_flight
        policy.maybe_save(step - 1, boundary)
        loop.step(policy)
        kind = "save" if policy.due(step - 1) else "in_flight" if was_in_flight else "clean"
        steps.append((time.perf_counter() - began, kind))
    return steps


def measure_stall(loop: Loop, manager: CheckpointManager, built: Built, saves: int,
                  commit_s: float) -> dict[str, Any]:
    """Steps that start a save against steps with no save in flight, in one loop.

    The interval leaves each save time to commit before the next is due (from the
    measured commit time and step time), so a save-starting step holds the save's own
    cost, not a wait for the previous one, and some steps run with no save in flight.
    """
    warm = run_steps(loop, policy_for(manager, built, NEVER), 2, 3)
    step_s = agreed(statistics.median([s for s, _ in warm[1:]]))
    # Twice the commit time measured alone: in the loop the writer shares the machine.
    interval = max(3, math.ceil(2 * commit_s / max(step_s, 1e-6)) + 2)
    policy = policy_for(manager, built, interval)
    steps = run_steps(loop, policy, interval + 1, interval * saves)
    policy.finish(Boundary())
    kinds = {kind: [s for s, k in steps if k == kind] for kind in ("save", "in_flight", "clean")}
    med = {kind: statistics.median(v) if v else None for kind, v in kinds.items()}
    stall = (med["save"] - med["clean"]) if med["save"] is not None and med["clean"] else None
    return {"stall": stall, "interval": interval, "step_s": med,
            "counts": {kind: len(v) for kind, v in kinds.items()},
            "failed_saves": manager.failed_saves}


def agreed(value: float) -> float:
    """Rank 0's value on every rank (decisions that change collectives must agree)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------- throughput --
def measure_throughput(loop: Loop, manager: CheckpointManager, built: Built, steps: int,
                       interval: int, repeats: int, tokens_per_sample: int | None
                       ) -> dict[str, Any]:
    """The same number of steps without and with checkpointing, alternately; the ratio
    of the median throughputs."""
    rates: dict[str, list[float]] = {"without": [], "with": []}
    run_steps(loop, policy_for(manager, built, NEVER), 2, 3)  # warm-up
    base = interval * 10
    saves_before = manager.failed_saves
    for repeat in range(repeats):
        # without, with, with, without, ...: a machine getting busier or quieter over
        # the run moves both figures alike.
        for kind in ("without", "with") if repeat % 2 == 0 else ("with", "without"):
            policy = policy_for(manager, built, interval if kind == "with" else NEVER)
            # The first save comes half an interval in, so the phase holds whole saves.
            first = base + interval - interval // 2 + 1
            dist.barrier()
            began = time.perf_counter()
            run_steps(loop, policy, first, steps)
            dist.barrier()
            elapsed = time.perf_counter() - began
            manager.wait()   # the last save, if any, outside the timed phase
            dist.barrier()
            rates[kind].append(steps * loop.split.global_batch_size / elapsed)
            base += interval * (steps // interval + 2)
    samples = {kind: statistics.median(v) for kind, v in rates.items()}
    return {
        "train_steps": steps, "interval": interval, "repeats": repeats,
        "samples_per_s": samples,
        "tokens_per_s": ({k: v * tokens_per_sample for k, v in samples.items()}
                         if tokens_per_sample else None),
        "throughput_ratio": samples["with"] / samples["without"],
        "failed_saves": manager.failed_saves - saves_before,
    }
