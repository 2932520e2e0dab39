"""The trainer's DataLoader: this rank's micro-batches from a data position on, its
workers started as configured (loader.*), deaf to the stop signals, ended at exit and
named when one dies."""

from __future__ import annotations

import atexit
import contextlib
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..config import LoaderConfig
from ..preemption.early import HELD as STOP_SIGNALS
from ..runtime.lifeline import follow_parent
from .sampling import GlobalBatchSampler, RankMicroBatches

# How long a failed batch read waits for a DataLoader worker that is dying to be reaped.
WORKER_EXIT_WAIT_S = 5.0


def micro_batches(dataset: Dataset, collate: Callable, sampler: GlobalBatchSampler, split: int,
                  rank: int, samples_consumed: int, seed: int, device: torch.device,
                  cfg: LoaderConfig) -> Iterator[Any]:
    """This rank's micro-batches from ``samples_consumed`` on, collated. ``seed`` seeds the
    loader's own generator: a draw from the default one would shift the saved streams."""
    workers = cfg.num_workers
    batches = iter(DataLoader(
        dataset, collate_fn=collate, num_workers=workers,
        batch_sampler=RankMicroBatches(sampler, split, rank, samples_consumed),
        pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(seed),
        worker_init_fn=ignore_preemption_signals if workers else None,
        multiprocessing_context=start_method(cfg.start_method, device) if workers else None,
        # Micro-batches each worker keeps ready (DataLoader refuses it without workers).
        prefetch_factor=cfg.prefetch_factor if workers else None,
        persistent_workers=workers > 0))
    if workers:
        atexit.register(end_workers_at_exit, weakref.ref(batches))
        return naming_dead_workers(batches)
    return batches


def start_method(method: str, device: torch.device) -> str:
    """loader.start_method; auto: forkserver on CUDA (docs/EXTENDING.md), else fork."""
    return ("forkserver" if device.type == "cuda" else "fork") if method == "auto" else method


def ignore_preemption_signals(_worker_id: int) -> None:
    # A stop signal to the shared process group is the trainer's; workers end with their parent.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    follow_parent()


def end_workers_at_exit(loader_iter: weakref.ref) -> None:
    """End a loader's workers before multiprocessing's exit handler joins them (atexit runs
    first): they ignore SIGTERM, so after a crash the process would wait for them forever."""
    if (it := loader_iter()) is None:
        return
    with contextlib.suppress(Exception):
        it._shutdown_workers()  # the loader's own orderly stop
    for worker in getattr(it, "_workers", ()):
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


def naming_dead_workers(loader_iter: Iterator[Any]) -> Iterator[Any]:
    """The loader's batches; a read failed by a dying worker names it. torch names only a
    reaped worker: one killed mid-handover can fail the read first (ConnectionResetError)."""
    while True:
        try:
            batch = next(loader_iter)
        except StopIteration:
            return
        except (OSError, EOFError) as exc:
            workers = getattr(loader_iter, "_workers", ())
            deadline = time.monotonic() + WORKER_EXIT_WAIT_S
            while (not (dead := [w.pid for w in workers if not w.is_alive()]) and workers
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            if dead:
                raise RuntimeError(f"DataLoader worker (pid(s) {', '.join(map(str, dead))}) "
                                   f"exited unexpectedly") from exc
            raise
        yield batch
