"""Checkpoint performance against what the machine allows, measured in one run.

    torchrun --nproc-per-node 2 -m <package>.bench [--repeats 3] [--json] [key=value ...]
    torchrun --nproc-per-node 2 -m <package>.bench --train-steps 50 [--interval 10]

Every figure is a median over ``--repeats``, on this configuration's real model and
optimizer state, with the same bytes, in the same run (so a busy machine moves all of
them alike):

- ``copy_bound``: copy this rank's state into preallocated host memory (pinned on CUDA,
  shared memory on CPU in process mode): the floor of the staging copy;
- ``async_blocking``: this project's save on the training path (the ``save`` call and
  the staging copy); ``async_commit``: until the checkpoint is committed;
- ``disk_bound``: every rank writes and fsyncs as many bytes as its shard, in parallel;
- ``baseline``: gather the full state on rank 0, ``torch.save`` it and fsync (the
  common way); ``dcp_sync``: a plain ``dcp.save``;
- ``load``: load the newest checkpoint through the resume path (``CheckpointManager.load``)
  and ``verify``: rank 0's checksum check before it; ``read_bound``: every rank reads
  the bytes of its own shard; ``baseline_load``: rank 0 ``torch.load`` and a broadcast.
  The checkpoint's files are dropped from the page cache first, as on a fresh machine;
- ``stall``: in a training loop (the trainer's step, the save policy), the median time
  of steps that start a save minus that of steps with no save in flight.

``--train-steps N`` instead trains N steps without and N steps with checkpointing every
``--interval`` steps, ``--repeats`` times alternately, and prints the throughput ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from . import exit_codes
from .checkpoint import CheckpointManager, LocalStorage
from .checkpoint.policy import SavePolicy, Vote
from .checkpoint.state import Progress, RankRNG, training_state
from .config import AsyncMode, Config, ConfigError, load_config
from .distributed import Runtime, set_gradient_sync, setup, teardown, to_device, wrap_model
from .metrics import MetricsLog
from .sampling import split_global_batch
from .task_contract import Task, load_task


class CountingPlanner(dcp.DefaultSavePlanner):
    """Plan caching on, counting the saves whose local plan came from the cache."""

    cache_hits = 0

    def create_local_plan(self):
        plan = super().create_local_plan()
        if not plan.usable:  # "unchanged since the cached plan": nothing to send
            CountingPlanner.cache_hits += 1
        return plan


def _timed(fn) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - began


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


def _local_tensors(state: Any) -> list[torch.Tensor]:
    """This rank's tensor data in the state, as staging copies it (local shards)."""
    if isinstance(state, Stateful):
        state = state.state_dict()
    if isinstance(state, dict):
        return [t for value in state.values() for t in _local_tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _local_tensors(value)]
    if isinstance(state, torch.Tensor):
        return [state.to_local() if hasattr(state, "to_local") else state]
    return []


def _local_bytes(state: dict) -> int:
    """Bytes of tensor data this rank holds (what staging copies into host memory)."""
    return sum(t.numel() * t.element_size() for t in _local_tensors(state))


def _drop_from_page_cache(paths: list[Path]) -> None:
    """Evict files from this machine's page cache, so that a read comes from the storage."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_file(path: Path, buffer: bytearray) -> int:
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            got = handle.readinto(buffer)
            if not got:
                return total
            total += got


def _any_rank(flag: bool) -> bool:
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


# ------------------------------------------------------------- a training loop --
class _Boundary:
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


class _Loop:
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


def _policy(manager: CheckpointManager, built: Built, interval: int) -> SavePolicy:
    return SavePolicy(manager, interval_steps=interval, final_step=-1,
                      state=lambda: built.state,
                      record=lambda: {"world_size": dist.get_world_size()},
                      metrics=MetricsLog(None), wait_timeout_s=600, max_failed_in_a_row=10**9)


def _run_steps(loop: _Loop, policy: SavePolicy, first: int, count: int) -> list[tuple[float, str]]:
    """Train ``count`` steps numbered from ``first``; time each from the end of the step
    before: the save policy's turn after that step (commit, vote, maybe a save), then
    this step, whose forward and backward pass overlap the staging copy of a save just
    started. Returns (seconds, "save" | "in_flight" | "clean") per step."""
    boundary = _Boundary()
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


def measure_stall(loop: _Loop, manager: CheckpointManager, built: Built, saves: int,
                  commit_s: float) -> dict[str, Any]:
    """Steps that start a save against steps with no save in flight, in one loop.

    The interval leaves each save time to commit before the next is due (from the
    measured commit time and step time), so a save-starting step holds the save's own
    cost, not a wait for the previous one, and some steps run with no save in flight.
    """
    warm = _run_steps(loop, _policy(manager, built, NEVER), 2, 3)
    step_s = _agreed(statistics.median([s for s, _ in warm[1:]]))
    # Twice the commit time measured alone: in the loop the writer shares the machine.
    interval = max(3, math.ceil(2 * commit_s / max(step_s, 1e-6)) + 2)
    policy = _policy(manager, built, interval)
    steps = _run_steps(loop, policy, interval + 1, interval * saves)
    policy.finish(_Boundary())
    kinds = {kind: [s for s, k in steps if k == kind] for kind in ("save", "in_flight", "clean")}
    med = {kind: statistics.median(v) if v else None for kind, v in kinds.items()}
    stall = (med["save"] - med["clean"]) if med["save"] is not None and med["clean"] else None
    return {"stall": stall, "interval": interval, "step_s": med,
            "counts": {kind: len(v) for kind, v in kinds.items()},
            "failed_saves": manager.failed_saves}


def _agreed(value: float) -> float:
    """Rank 0's value on every rank (decisions that change collectives must agree)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------- throughput --
def measure_throughput(loop: _Loop, manager: CheckpointManager, built: Built, steps: int,
                       interval: int, repeats: int, tokens_per_sample: int | None
                       ) -> dict[str, Any]:
    """The same number of steps without and with checkpointing, alternately; the ratio
    of the median throughputs."""
    rates: dict[str, list[float]] = {"without": [], "with": []}
    _run_steps(loop, _policy(manager, built, NEVER), 2, 3)  # warm-up
    base = interval * 10
    saves_before = manager.failed_saves
    for repeat in range(repeats):
        # without, with, with, without, ...: a machine getting busier or quieter over
        # the run moves both figures alike.
        for kind in ("without", "with") if repeat % 2 == 0 else ("with", "without"):
            policy = _policy(manager, built, interval if kind == "with" else NEVER)
            # The first save comes half an interval in, so the phase holds whole saves.
            first = base + interval - interval // 2 + 1
            dist.barrier()
            began = time.perf_counter()
            _run_steps(loop, policy, first, steps)
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


# ---------------------------------------------------------------------- main --
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"torchrun --nproc-per-node N -m {__package__}.bench",
        description=__doc__.split("\n\n")[0],
        epilog=f"Run it under torchrun, on the GPUs (and the storage) training uses: "
               f"torchrun --nproc-per-node 2 -m {__package__}.bench. Every rank writes its "
               f"own shard, so the figures depend on the number of ranks. What each figure "
               f"means: docs/PERFORMANCE.md.")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (>= 1)")
    parser.add_argument("--dir", default=None,
                        help="scratch directory on the storage to measure (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    parser.add_argument("--train-steps", type=int, default=None, metavar="N",
                        help="instead: train N steps without and N with checkpointing, "
                             "print the throughput ratio")
    parser.add_argument("--interval", type=int, default=None, metavar="K",
                        help="with --train-steps: save every K steps "
                             "(default checkpoint.interval_steps)")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in ("repeats", "train_steps", "interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return exit_codes.BAD_INPUT
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    mode = AsyncMode(cfg.checkpoint.async_mode)
    if mode == AsyncMode.sync:
        print("error: bench measures background saves: checkpoint.async_mode must be "
              "process or thread", file=sys.stderr)
        return exit_codes.BAD_INPUT
    runtime = setup(cfg.distributed)
    scratch_root = [args.dir or (tempfile.mkdtemp(prefix="bench-") if runtime.is_main else None)]
    dist.broadcast_object_list(scratch_root, src=0)
    root = Path(scratch_root[0])
    try:
        manager = CheckpointManager(LocalStorage(root / "async"), mode=mode, keep_last=1,
                                    is_coordinator=runtime.is_main, device=runtime.device)
        manager.prepare()
        task = load_task()
        try:
            built = build_state(cfg, task, runtime)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exit_codes.BAD_INPUT
        began = time.perf_counter()
        failure = manager.warm_up(built.state, cfg.checkpoint.start_timeout_s,
                                  str(root / f"checkpoint-process.rank{runtime.rank}.log"))
        if _any_rank(failure is not None):
            print(f"error: {failure or 'the checkpoint process did not start on every rank'}",
                  file=sys.stderr)
            return exit_codes.BAD_INPUT
        warm_up_s = time.perf_counter() - began
        loop = _Loop(cfg, task, built, runtime)
        if args.train_steps is not None:
            report = measure_throughput(
                loop, manager, built, args.train_steps,
                args.interval or cfg.checkpoint.interval_steps, args.repeats,
                int(cfg.data.get("seq_len", 0)) or None)
            manager.close()
            report = {"world_size": runtime.world_size, "mode": mode.value, **report}
            if runtime.is_main:
                print(json.dumps(report) if args.json else _throughput_text(report))
            return 0
        report = _measure(args, cfg, runtime, root, manager, built, loop, mode)
        report["warm_up_s"] = warm_up_s
        if runtime.is_main:
            print(json.dumps(report) if args.json else _report_text(report))
        return 0
    finally:
        if not args.dir and runtime.is_main:
            shutil.rmtree(root, ignore_errors=True)
        teardown()


def _measure(args: argparse.Namespace, cfg: Config, runtime: Runtime, root: Path,
             manager: CheckpointManager, built: Built, loop: _Loop,
             mode: AsyncMode) -> dict[str, Any]:
    model, optimizer, state = built.model, built.optimizer, built.state
    say = print if runtime.is_main and not args.json else (lambda *a, **k: None)
    stager = getattr(manager, "_stager", None)   # closed (None) once the loop has finished
    tensors = _local_tensors(state)
    local_bytes = sum(t.numel() * t.element_size() for t in tensors)
    say(f"benchmarking on {runtime.world_size} rank(s), {args.repeats} repeats, "
        f"{local_bytes / 2**20:.1f} MiB of state on rank 0, scratch {root}")
    timings: dict[str, list[float]] = {}

    def measure(name: str, fn, *, before=None) -> None:
        fn(-1)  # warm-up: first-call costs (allocation, planning) are not the steady state
        timings[name] = []
        for i in range(args.repeats):
            if before is not None:
                before(i)
            timings[name].append(_timed(lambda i=i: fn(i)))
        say(f"  {name:<15} median {statistics.median(timings[name]):.3f} s")

    # -- the floors: a host copy, a parallel write ---------------------------------
    on_gpu = runtime.device.type == "cuda"
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu) for t in tensors]
    if not on_gpu and mode == AsyncMode.process:
        buffers = [b.share_memory_() for b in buffers]

    def copy_bound(_: int) -> None:
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize(runtime.device)

    measure("copy_bound", copy_bound)
    buffers.clear()   # the memory goes back before the saves stage theirs
    payload = os.urandom(1 << 20)

    def disk_bound(i: int) -> None:
        target = root / f"raw_{i}_{runtime.rank}.bin"
        with open(target, "wb") as handle:
            handle.writelines(payload for _ in range(max(1, -(-local_bytes >> 20))))
            handle.flush()
            os.fsync(handle.fileno())

    measure("disk_bound", disk_bound)

    # -- the common ways -----------------------------------------------------------
    def baseline(i: int) -> None:
        full_model, full_optim = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if runtime.is_main:
            target = root / f"baseline_{i}.pt"
            torch.save({"model": full_model, "optim": full_optim}, target)
            with open(target, "rb") as handle:
                os.fsync(handle.fileno())

    def dcp_sync(i: int) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(root / f"dcp_{i}", sync_files=True),
                 planner=CountingPlanner(enable_plan_caching=True))

    measure("baseline", baseline)
    measure("dcp_sync", dcp_sync)
    cache_hits = CountingPlanner.cache_hits

    # -- this project's saves --------------------------------------------------------
    timings["async_blocking"], timings["async_commit"] = [], []
    first: dict[str, float] = {}
    for i in range(args.repeats + 1):  # the first save of the run, then the timed ones
        built.progress.step = 100 + i
        dist.barrier()
        manager.save(built.progress.step, state, "interval", {"world_size": runtime.world_size})
        manager.wait_staged()
        result = manager.wait()
        if _any_rank(runtime.is_main and result is None):
            raise RuntimeError(f"a save failed during the benchmark: {manager.last_error}")
        if runtime.is_main:
            if i == 0:
                first = {"blocking_s": result.blocking_s, "commit_s": result.commit_latency_s}
            else:
                timings["async_blocking"].append(result.blocking_s)
                timings["async_commit"].append(result.commit_latency_s)
    for name in ("async_blocking", "async_commit"):
        say(f"  {name:<15} median {statistics.median(timings[name] or [0]):.3f} s")

    # -- loading -----------------------------------------------------------------------
    newest = [manager.newest() if runtime.is_main else None]
    dist.broadcast_object_list(newest, src=0)
    checkpoint = newest[0]
    files = sorted(Path(checkpoint.path).iterdir())
    own = [Path(checkpoint.path) / f"__{runtime.rank}_0.distcp", Path(checkpoint.path) / ".metadata"]
    evict = (lambda _: _drop_from_page_cache(files)) if runtime.is_main else None

    def verify(_: int) -> None:
        if runtime.is_main and manager.newest() is None:
            raise RuntimeError("the newest checkpoint did not verify")

    def load(_: int) -> None:
        manager.load(state, checkpoint)

    buffer = bytearray(8 << 20)

    def read_bound(_: int) -> None:
        for path in own:
            _read_file(path, buffer)

    measure("verify", verify, before=evict)
    measure("load", load, before=evict)
    measure("read_bound", read_bound, before=evict)
    baseline_file = root / f"baseline_{args.repeats - 1}.pt"
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def baseline_load(_: int) -> None:
        # Rank 0 reads the file and broadcasts it tensor by tensor; every rank keeps its
        # shard. The other ranks' model state only says "not optimizer-only" (ignored).
        if runtime.is_main:
            full = torch.load(baseline_file, weights_only=True)
            model_state, optim_state = full["model"], full["optim"]
        else:
            model_state, optim_state = get_model_state_dict(model), {}
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=optim_state, options=options)

    measure("baseline_load", baseline_load, before=(
        (lambda _: _drop_from_page_cache([baseline_file])) if runtime.is_main else None))

    # -- in a training loop ------------------------------------------------------------
    commit_s = _agreed(statistics.median(timings["async_commit"]) if runtime.is_main else 0.0)
    loop_figures = measure_stall(loop, manager, built, args.repeats + 1, commit_s)
    timings["stall"] = [loop_figures["stall"]] if loop_figures["stall"] is not None else []
    say(f"  {'stall':<15} {_fmt(loop_figures['stall'])} s (steps: {loop_figures['step_s']})")

    if not runtime.is_main:   # the saves' results and the report are rank 0's
        return {}
    med = {name: statistics.median(values) if values else None
           for name, values in timings.items()}
    staged = (getattr(stager, "fast_stages", 0), getattr(stager, "full_stages", 0))
    return {
        "world_size": runtime.world_size,
        "mode": mode.value,
        "device": runtime.device.type,
        "state_bytes_rank0": local_bytes,
        "staging_bytes_per_rank": local_bytes,
        "median_s": med,
        "ratios": _ratios(med),
        "first_save": first,
        "loop": loop_figures,
        "baseline_over_dcp_sync": med["baseline"] / med["dcp_sync"],
        "baseline_over_async_blocking": med["baseline"] / med["async_blocking"],
        "dcp_sync_over_disk_bound": med["dcp_sync"] / med["disk_bound"],
        "plan_cache_hits": cache_hits,
        "plan_cache_possible": args.repeats,
        "staged_fast": staged[0],
        "staged_full": staged[1],
        "repeats": args.repeats,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(med: dict[str, float | None]) -> dict[str, float | None]:
    """The ratios the targets are stated in (docs/PERFORMANCE.md)."""
    return {
        "baseline/blocking": _ratio(med["baseline"], med["async_blocking"]),
        "blocking/copy_bound": _ratio(med["async_blocking"], med["copy_bound"]),
        "commit/disk_bound": _ratio(med["async_commit"], med["disk_bound"]),
        "load/read_bound": _ratio(med["load"], med["read_bound"]),
        "stall/copy_bound": _ratio(med["stall"], med["copy_bound"]),
    }


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def _report_text(r: dict) -> str:
    med, first, loop = r["median_s"], r["first_save"], r["loop"]
    rows = [
        ("copy bound (host copy of the state)", "copy_bound"),
        ("async: on the training path", "async_blocking"),
        ("async: until committed", "async_commit"),
        ("disk bound (raw parallel write)", "disk_bound"),
        ("rank-0 gather + torch.save", "baseline"),
        ("dcp.save (parallel shards)", "dcp_sync"),
        ("load through the resume path", "load"),
        ("  its checksum check (rank 0)", "verify"),
        ("read bound (each rank its shard)", "read_bound"),
        ("rank-0 torch.load + broadcast", "baseline_load"),
        ("stall in the training loop", "stall"),
    ]
    lines = [(f"\ncheckpoint figures, median of {r['repeats']} ({r['world_size']} {r['device']} "
              f"rank(s), {r['mode']} mode, {r['state_bytes_rank0'] / 2**20:.1f} MiB per rank):")]
    lines += [f"  {label:<38} {_fmt(med[key]):>8} s" for label, key in rows]
    lines.append("ratios:")
    lines += [f"  {name:<24} {_fmt(value, '7.2f')}x" for name, value in r["ratios"].items()]
    steps = loop["step_s"]
    lines += [
        (f"training loop: save every {loop['interval']} steps; median step "
         f"{_fmt(steps['clean'])} s with no save in flight ({loop['counts']['clean']}), "
         f"{_fmt(steps['save'])} s starting a save ({loop['counts']['save']}), "
         f"{_fmt(steps['in_flight'])} s while one is written ({loop['counts']['in_flight']})"),
        (f"warm-up: checkpoint process and staging buffers ready in {r['warm_up_s']:.2f} s; "
         f"the first save then blocked {_fmt(first.get('blocking_s'))} s and committed after "
         f"{_fmt(first.get('commit_s'))} s (later saves: {_fmt(med['async_blocking'])} s, "
         f"{_fmt(med['async_commit'])} s)"),
        (f"staging memory per rank {r['staging_bytes_per_rank'] / 2**20:.1f} MiB (held "
         f"while a save is in flight); {r['staged_fast']} of {r['staged_fast'] + r['staged_full']}"
         f" stagings reused the buffers' layout"),
        (f"plan cache hits {r['plan_cache_hits']} of {r['plan_cache_possible']} timed "
         f"dcp.save calls"),
    ]
    return "\n".join(lines)


def _throughput_text(r: dict) -> str:
    rate = r["samples_per_s"]
    tokens = r["tokens_per_s"]
    unit = (f"{tokens['without']:,.0f} -> {tokens['with']:,.0f} tokens/s" if tokens
            else f"{rate['without']:.2f} -> {rate['with']:.2f} samples/s")
    return (f"{r['train_steps']} steps without and with a save every {r['interval']} steps "
            f"({r['world_size']} rank(s), {r['mode']} mode, median of {r['repeats']}): "
            f"{unit}; throughput with checkpointing {r['throughput_ratio']:.3f}x of without")


if __name__ == "__main__":
    sys.exit(main())
