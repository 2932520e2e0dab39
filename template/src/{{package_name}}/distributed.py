"""Process group, device and model wrapping (FSDP2 or DDP), set up once per process."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import Config, ConfigError, DistributedConfig, Parallelism, Precision


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
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


def setup(cfg: DistributedConfig,
          collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Runtime:
    """Join (or, without torchrun, create) the process group and pick the device.

    Run without torchrun, the process makes itself a one-rank group, so the same code
    path (FSDP2, DCP, the background checkpoint process) serves both cases.

    ``collective_timeout_s`` bounds each collective (gloo; NCCL with its async error
    handling). It is longer than the step watchdog's bound on purpose: outside the
    training loop collectives wait legitimately for minutes (rank 0 checksumming the
    checkpoint before the broadcast of its choice, the commit barrier, a synchronous
    final save), and inside the loop the watchdog fires first, with every thread's
    stack, instead of a bare timeout error (docs/RECOVERY.md).
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # DCP's background checkpoint processes then share this job's store (under a prefix)
    # instead of opening an unauthenticated TCPStore of their own on every interface.
    os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # CPU collectives are needed for the preemption vote and DCP's own coordination
        # even when training uses NCCL.
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        dist.init_process_group(pg_backend,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, units: list[nn.Module], cfg: Config,
               runtime: Runtime) -> nn.Module:
    """Shard the model with FSDP2 (each unit, then the root) or replicate it with DDP.

    ``train.activation_checkpointing`` recomputes each unit's activations in the backward
    pass instead of keeping them. ``train.precision=bf16`` (CUDA and FSDP2 only) computes
    in bf16 and reduces gradients in fp32; the weights and optimizer state stay fp32.
    """
    bf16 = cfg.train.precision == Precision.bf16
    if bf16 and runtime.device.type != "cuda":
        raise ConfigError(f"train.precision=bf16 needs CUDA (this run is on "
                          f"{runtime.device.type}); use train.precision=fp32")
    if bf16 and cfg.distributed.parallelism != Parallelism.fsdp:
        raise ConfigError("train.precision=bf16 needs distributed.parallelism=fsdp (FSDP2's "
                          "mixed precision)")
    model.to(runtime.device)
    if cfg.train.activation_checkpointing:
        for unit in units:
            checkpoint_activations(unit)
    if cfg.distributed.parallelism == Parallelism.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if bf16 else MixedPrecisionPolicy())
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [runtime.local_rank] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in the backward pass instead of storing them.

    Its forward runs under ``torch.utils.checkpoint`` (non-reentrant, random state
    preserved, so results are unchanged). The module stays where it is: parameter names,
    and with them checkpoints, are the same with and without.
    """
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def set_gradient_sync(model: nn.Module, parallelism: Parallelism, enabled: bool) -> None:
    """Reduce gradients across ranks in the next backward pass, or only accumulate them.

    Gradient accumulation syncs on its last micro-batch only.
    """
    if parallelism == Parallelism.fsdp:
        model.set_requires_gradient_sync(enabled)
    else:
        model.require_backward_grad_sync = enabled


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a collated batch (tensors, tuples, lists, dicts) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch
