"""Save-time benchmark: this project's checkpointing against the rank-0 baseline and the disk.

    torchrun --nproc-per-node 2 -m <package>.bench [--repeats 3] [--dir DIR] [key=value ...]

Measured in one run, on the real model and optimizer state of this configuration:

- baseline: gather the full state on rank 0, ``torch.save`` it and fsync (the common way);
- dcp sync: ``dcp.save`` (every rank writes its own shard in parallel);
- async: this project's save pipeline, time on the training path (blocking) and until the
  checkpoint is committed;
- disk bound: every rank writes and fsyncs as many bytes as its shard, in parallel (what
  the storage allows, whatever the format).

It prints medians and the ratios between them, the host memory that staging a save takes
per rank, and how many save plans were served from the plan cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from . import exit_codes
from .checkpoint import CheckpointManager, LocalStorage
from .checkpoint.state import Progress, RankRNG, training_state
from .config import AsyncMode, Config, ConfigError, load_config
from .distributed import Runtime, setup, teardown, to_device, wrap_model
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


def build_state(cfg: Config, task: Task, runtime: Runtime):
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
    return model, optimizer, progress, state


def _local_bytes(state: dict) -> int:
    """Bytes of tensor data this rank holds (what staging copies into host memory)."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _local_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"torchrun --nproc-per-node N -m {__package__}.bench",
        description=__doc__.split("\n\n")[0],
        epilog=f"Run it under torchrun, on the GPUs (and the storage) training uses: "
               f"torchrun --nproc-per-node 2 -m {__package__}.bench. Every rank writes its "
               f"own shard, so the figures depend on the number of ranks.")
    parser.add_argument("--repeats", type=int, default=3, help="timed saves per method (>= 1)")
    parser.add_argument("--dir", default=None,
                        help="scratch directory on the storage to measure (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        print("error: --repeats must be >= 1", file=sys.stderr)
        return exit_codes.BAD_INPUT
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    runtime = setup(cfg.distributed)
    scratch_root = [args.dir or (tempfile.mkdtemp(prefix="bench-") if runtime.is_main else None)]
    dist.broadcast_object_list(scratch_root, src=0)
    root = Path(scratch_root[0])
    say = print if runtime.is_main else (lambda *a, **k: None)
    try:
        manager = CheckpointManager(LocalStorage(root / "async"), mode=AsyncMode.process,
                                    keep_last=1, is_coordinator=runtime.is_main,
                                    device=runtime.device)
        manager.prepare()
        try:
            model, optimizer, progress, state = build_state(cfg, load_task(), runtime)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exit_codes.BAD_INPUT
        local_bytes = _local_bytes({k: v.state_dict() for k, v in state.items()})
        say(f"benchmarking {args.repeats} saves per method on {runtime.world_size} rank(s), "
            f"{local_bytes / 2**20:.1f} MiB of state on rank 0, scratch {root}")

        def baseline(i: int) -> None:
            full_model, full_optim = get_state_dict(
                model, optimizer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if runtime.is_main:
                target = root / f"baseline_{i}.pt"
                torch.save({"model": full_model, "optim": full_optim}, target)
                with open(target, "rb") as handle:
                    os.fsync(handle.fileno())

        def dcp_sync(i: int) -> None:
            target = root / f"dcp_{i}"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(target, sync_files=True),
                     planner=CountingPlanner(enable_plan_caching=True))

        payload = os.urandom(1 << 20)

        def disk_bound(i: int) -> None:
            target = root / f"raw_{i}_{runtime.rank}.bin"
            with open(target, "wb") as handle:
                handle.writelines(payload for _ in range(max(1, -(-local_bytes >> 20))))
                handle.flush()
                os.fsync(handle.fileno())

        timings: dict[str, list[float]] = {"baseline": [], "dcp_sync": [], "disk_bound": [],
                                           "async_blocking": [], "async_commit": []}
        for name, fn in (("baseline", baseline), ("dcp_sync", dcp_sync),
                         ("disk_bound", disk_bound)):
            fn(-1)  # warm-up: first-call costs (allocation, planning) are not the steady state
            for i in range(args.repeats):
                timings[name].append(_timed(lambda fn=fn, i=i: fn(i)))
            say(f"  {name:<15} median {statistics.median(timings[name]):.3f} s")
        cache_hits = CountingPlanner.cache_hits

        for i in range(args.repeats + 1):  # the first save spawns the checkpoint process
            progress.step = i + 1
            dist.barrier()
            manager.save(progress.step, state, "interval", {"world_size": runtime.world_size})
            manager.wait_staged()
            result = manager.wait()
            if result is None and runtime.is_main:
                raise RuntimeError("an async save failed during the benchmark (see the log)")
            if i > 0 and runtime.is_main:
                timings["async_blocking"].append(result.blocking_s)
                timings["async_commit"].append(result.commit_latency_s)
        manager.close()
        for name in ("async_blocking", "async_commit"):
            if runtime.is_main:
                say(f"  {name:<15} median {statistics.median(timings[name]):.3f} s")

        if runtime.is_main:
            med = {name: statistics.median(values) for name, values in timings.items()}
            report = {
                "world_size": runtime.world_size,
                "state_bytes_rank0": local_bytes,
                "staging_bytes_per_rank": local_bytes,
                "median_s": med,
                "baseline_over_dcp_sync": med["baseline"] / med["dcp_sync"],
                "baseline_over_async_blocking": med["baseline"] / med["async_blocking"],
                "dcp_sync_over_disk_bound": med["dcp_sync"] / med["disk_bound"],
                "plan_cache_hits": cache_hits,
                "plan_cache_possible": args.repeats,
                "repeats": args.repeats,
            }
            if args.json:
                print(json.dumps(report))
            else:
                _print_report(report)
        return 0
    finally:
        if not args.dir and runtime.is_main:
            shutil.rmtree(root, ignore_errors=True)
        teardown()


def _print_report(r: dict) -> None:
    med = r["median_s"]
    print(f"\nsave time, median of {r['repeats']} (world size {r['world_size']}):")
    rows = [("rank-0 gather + torch.save", med["baseline"]),
            ("dcp.save (parallel shards)", med["dcp_sync"]),
            ("async: on the training path", med["async_blocking"]),
            ("async: until committed", med["async_commit"]),
            ("disk bound (raw parallel write)", med["disk_bound"])]
    for label, value in rows:
        print(f"  {label:<34} {value:8.3f} s")
    print(f"  baseline / dcp.save            {r['baseline_over_dcp_sync']:6.1f}x")
    print(f"  baseline / async blocking      {r['baseline_over_async_blocking']:6.1f}x")
    print(f"  dcp.save / disk bound          {r['dcp_sync_over_disk_bound']:6.2f}x")
    print(f"  staging memory per rank        {r['staging_bytes_per_rank'] / 2**20:8.1f} MiB "
          f"(host copy held while a save is in flight)")
    print(f"  plan cache hits                {r['plan_cache_hits']} of {r['plan_cache_possible']} "
          f"timed dcp.save calls")


if __name__ == "__main__":
    sys.exit(main())
