"""Checkpoint performance against what the machine allows, measured in one run.

    torchrun --nproc-per-node 2 -m <package>.bench [--repeats 3] [--json] [key=value ...]
    torchrun --nproc-per-node 2 -m <package>.bench --train-steps 50 [--interval 10]
    python -m <package>.bench --restart [--repeats 5] [--nproc 2]

Medians over ``--repeats`` on this configuration's real state, all measured in one run (a
busy machine moves them alike); each figure and the target ratios: docs/PERFORMANCE.md. The
loop, the text and ``--restart``: bench_loop.py, bench_report.py, bench_restart.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

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

from .. import PACKAGE
from ..checkpoint import CheckpointRefused
from ..checkpoint.load.restore import load_checkpoint
from ..checkpoint.save.dcp_planner import TrainingStatePlanner
from ..config import AsyncMode, ConfigError, load_config, parts
from ..loop.task_contract import load_task
from ..runtime.distributed import (
    BackendUnavailable,
    Runtime,
    any_rank,
    decide_on_rank0,
    setup,
    teardown,
)
from ..runtime.exit_codes import Refused, refusals
from ..runtime.output_dirs import make_output_dir
from ..runtime.torch_compat import torch_too_old
from . import bench_restart
from .bench_loop import (
    Bench,
    bench_config,
    build_trainer,
    measure_stall,
    measure_throughput,
    timed,
)
from .bench_report import fmt, ratios, report_text, throughput_text


class PlainDcpPlanner(TrainingStatePlanner):
    """A plain ``dcp.save``'s planner: its own class keeps its plan cache and hit count apart."""

    cache_hits = 0


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"torchrun --nproc-per-node N -m {PACKAGE}.bench",
        description=__doc__.split("\n\n")[0],
        epilog=f"Run it under torchrun, on the GPUs (and the storage) training uses: "
               f"torchrun --nproc-per-node 2 -m {PACKAGE}.bench. Every rank writes its "
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
    parser.add_argument("--restart", action="store_true",
                        help="instead: time restarts (a stopped job resumed, a worker killed) "
                             "with their phases; run with python, not under torchrun")
    parser.add_argument("--nproc", type=int, default=2, metavar="N",
                        help="with --restart: ranks of the jobs it launches (default 2)")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


@refusals
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in ("repeats", "train_steps", "interval", "nproc"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise Refused(f"--{name.replace('_', '-')} must be >= 1")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        raise Refused(exc) from exc
    if (too_old := torch_too_old()) is not None:   # runtime/torch_compat.py, MIN_TORCH
        raise Refused(too_old)
    if args.restart:
        return bench_restart.main(cfg, args.overrides, repeats=args.repeats, nproc=args.nproc,
                                  as_json=args.json, directory=args.dir)
    if args.dir and "://" in args.dir:
        raise Refused(f"--dir {args.dir}: bench measures a local path (its disk and read "
                      "bounds are local file operations); give a directory on the disk or "
                      "mounted filesystem to measure")
    mode = AsyncMode(cfg.checkpoint.async_mode)
    if mode == AsyncMode.sync:
        raise Refused("bench measures background saves: checkpoint.async_mode must be "
                      "process or thread")
    try:
        runtime = setup(cfg.distributed.backend)
    except BackendUnavailable as exc:
        raise Refused(exc) from exc
    try:   # a --dir made here ignores itself in git
        root = Path(decide_on_rank0(lambda: str(make_output_dir(args.dir)) if args.dir
                                    else tempfile.mkdtemp(prefix="bench-")))
    except OSError as exc:
        teardown()
        raise Refused(f"--dir {args.dir}: {(exc.strerror or str(exc)).lower()}") from exc
    bench = None
    try:
        try:
            task = load_task()   # a task that breaks its contract: one line, exit 2
            began = time.perf_counter()
            bench = build_trainer(bench_config(cfg, root / "async"), task, runtime)
        except (ConfigError, CheckpointRefused) as exc:   # exit 2, whatever its status
            raise Refused(exc) from exc
        warm_up_s = time.perf_counter() - began
        pipeline = bench.checkpointer.pipeline
        if any_rank(bench.checkpointer.synchronous)[0]:
            raise Refused(pipeline.last_error or "the checkpoint process did not start")
        if args.train_steps is not None:
            report = {"world_size": runtime.world_size, "mode": mode.value, **measure_throughput(
                bench, args.train_steps, args.interval or cfg.checkpoint.interval_steps,
                args.repeats, int(cfg.data.get("seq_len", 0)) or None)}
            pipeline.close()
            text = throughput_text
        else:
            report = {**_measure(args, runtime, root, bench, mode), "warm_up_s": warm_up_s}
            text = report_text
        if runtime.is_main:
            print(json.dumps(report) if args.json else text(report))
        return 0
    finally:
        if bench is not None:
            bench.checkpointer.release()
        if not args.dir and runtime.is_main:
            shutil.rmtree(root, ignore_errors=True)
        teardown()


def _measure(args: argparse.Namespace, runtime: Runtime, root: Path, bench: Bench,
             mode: AsyncMode) -> dict[str, Any]:
    trainer, pipeline = bench.trainer, bench.checkpointer.pipeline
    model, optimizer, state = trainer.model, trainer.optimizer, trainer.state()
    say = print if runtime.is_main and not args.json else (lambda *a, **k: None)
    stager = getattr(pipeline, "_stager", None)   # closed (None) once the loop has finished
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
            timings[name].append(timed(lambda i=i: fn(i)))
        say(f"  {name:<15} median {statistics.median(timings[name]):.3f} s")

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
        with open(root / f"raw_{i}_{runtime.rank}.bin", "wb") as handle:
            handle.writelines(payload for _ in range(max(1, -(-local_bytes >> 20))))
            handle.flush()
            os.fsync(handle.fileno())

    measure("disk_bound", disk_bound)

    def baseline(i: int) -> None:
        full_model, full_optim = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if runtime.is_main:
            target = root / f"baseline_{i}.pt"
            torch.save({"model": full_model, "optim": full_optim}, target)
            with open(target, "rb") as handle:
                os.fsync(handle.fileno())

    measure("baseline", baseline)
    measure("dcp_sync", lambda i: dcp.save(
        state, storage_writer=dcp.FileSystemWriter(root / f"dcp_{i}", sync_files=True),
        planner=PlainDcpPlanner(enable_plan_caching=True)))
    cache_hits = PlainDcpPlanner.cache_hits

    timings["async_blocking"], timings["async_commit"] = [], []
    first: dict[str, float] = {}
    for i in range(args.repeats + 1):  # the first save of the run, then the timed ones
        trainer.progress.step = 100 + i
        dist.barrier()
        pipeline.save(trainer.progress.step, state, "interval", trainer.commit_record())
        pipeline.wait_staged()
        result = pipeline.wait()
        if any_rank(runtime.is_main and result is None)[0]:
            raise RuntimeError(f"a save failed during the benchmark: {pipeline.last_error}")
        if runtime.is_main:
            if i == 0:
                first = {"blocking_s": result.blocking_s, "commit_s": result.commit_latency_s}
            else:
                timings["async_blocking"].append(result.blocking_s)
                timings["async_commit"].append(result.commit_latency_s)
    for name in ("async_blocking", "async_commit"):
        say(f"  {name:<15} median {statistics.median(timings[name] or [0]):.3f} s")

    checkpoint = decide_on_rank0(pipeline.newest)
    files = sorted(Path(checkpoint.path).iterdir())
    own = [Path(checkpoint.path) / f"__{runtime.rank}_0.distcp", Path(checkpoint.path) / ".metadata"]
    evict = (lambda _: _drop_from_page_cache(files)) if runtime.is_main else None

    def verify(_: int) -> None:
        if runtime.is_main and pipeline.newest() is None:
            raise RuntimeError("the newest checkpoint did not verify")

    buffer = bytearray(8 << 20)

    def read_bound(_: int) -> None:
        for path in own:
            with open(path, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass

    measure("verify", verify, before=evict)
    measure("load", lambda _: load_checkpoint(pipeline.storage, state, checkpoint,
                                              pipeline.verify), before=evict)
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

    memory = {"held_bytes": None, "nodes": None}
    if parts.rendered(parts.MEMORY_TIER):
        from .bench_memory import measure_memory
        memory = measure_memory(bench, state, timings, args.repeats)
        for name in ("memory_save", "memory_load", "memory_load_sampled", "memory_load_checked",
                     "memory_check"):
            say(f"  {name:<15} median {statistics.median(timings[name]):.3f} s")
    else:
        say("  memory tier     not rendered (copier answer memory_tier): not measured")

    commit_s = decide_on_rank0(lambda: statistics.median(timings["async_commit"]))
    loop_figures = measure_stall(bench, args.repeats + 1, commit_s)
    timings["stall"] = [loop_figures["stall"]] if loop_figures["stall"] is not None else []
    say(f"  {'stall':<15} {fmt(loop_figures['stall'])} s (steps: {loop_figures['step_s']})")

    if not runtime.is_main:   # the saves' results and the report are rank 0's
        return {}
    med = {name: statistics.median(values) if values else None for name, values in timings.items()}
    return {
        "world_size": runtime.world_size,
        "mode": mode.value,
        "device": runtime.device.type,
        "state_bytes_rank0": local_bytes,
        "staging_bytes_per_rank": local_bytes,
        "median_s": med,
        "ratios": ratios(med),
        "first_save": first,
        "loop": loop_figures,
        "baseline_over_dcp_sync": med["baseline"] / med["dcp_sync"],
        "baseline_over_async_blocking": med["baseline"] / med["async_blocking"],
        "dcp_sync_over_disk_bound": med["dcp_sync"] / med["disk_bound"],
        "memory_held_bytes_rank0": memory["held_bytes"],
        "memory_nodes": memory["nodes"],
        "plan_cache_hits": cache_hits,
        "plan_cache_possible": args.repeats,
        "staged_fast": getattr(stager, "fast_stages", 0),
        "staged_full": getattr(stager, "full_stages", 0),
        "repeats": args.repeats,
    }
