"""Process group and device, set up once per process, and the collectives every part shares."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The process group's default bound on one collective (recovery.collective_timeout_s).
DEFAULT_COLLECTIVE_TIMEOUT_S = 900.0


class BackendUnavailable(ValueError):
    """distributed.backend names a backend this machine cannot run (exit status 2)."""


def setup(backend: str = "auto",
          collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Runtime:
    """Join the process group (without torchrun: make a one-rank one, so the same code path
    serves both) and pick the device. ``backend``: auto (nccl with CUDA, else gloo), nccl, gloo.
    ``collective_timeout_s`` is longer than the watchdog's bound on purpose (docs/RECOVERY.md)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # DCP's checkpoint processes share this job's store, not an unauthenticated one of theirs.
    os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        missing = "no CUDA device" if not torch.cuda.is_available() else "a torch without NCCL"
        raise BackendUnavailable(f"distributed.backend=nccl needs CUDA GPUs and a torch built "
                                 f"with NCCL; this machine has {missing}: use "
                                 "distributed.backend=auto (nccl with CUDA, gloo otherwise) or "
                                 "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if os.environ["RANK"] != "0":
            _wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                            collective_timeout_s)
        # CPU collectives (the preemption vote, DCP's coordination) even with NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


STORE_POLL_S = 0.01


def _wait_for_store(host: str, port: int, bound_s: float) -> None:
    """Until rank 0's store listens, at most ``bound_s``: a TCPStore client that finds no
    server retries only after 0.3 s or more, which an in-place restart paid."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(STORE_POLL_S)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------- collectives: what every rank decides alike --

def _several_ranks() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def decide_on_rank0(decide: Callable[[], T]) -> T:
    """Rank 0 (only) runs ``decide()``; every rank returns its value or raises its exception."""
    if not _several_ranks():
        return decide()
    box: list = [None, None]   # the value, the exception
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except Exception as exc:  # noqa: BLE001 - raised again below, on every rank
            failure = exc
            try:
                pickle.dumps(exc)
                box[1] = exc
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                box[1] = RuntimeError(f"on rank 0: {type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise failure or box[1]   # rank 0: its own exception (src's box is left as it was)
    return box[0]


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag, true on every rank when it is true on any rank (one small all-reduce)."""
    if not _several_ranks():
        return tuple(bool(f) for f in flags)
    tensor = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in tensor.tolist())


def highest(value: int) -> int:
    """The largest of every rank's ``value`` (one small all-reduce)."""
    if not _several_ranks():
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
