"""How the model is spread over the ranks: FSDP2 sharding or DDP replicas, activation
checkpointing, compilation, gradient sync under accumulation, and batches moved to the
device."""

from __future__ import annotations

import shutil
from typing import Any

import torch
from torch import nn

from ..config import Config, ConfigError, Parallelism, Precision
from ..runtime.distributed import Runtime


def wrap_model(model: nn.Module, units: list[nn.Module], cfg: Config,
               runtime: Runtime) -> nn.Module:
    """Shard the model with FSDP2 (each unit, then the root) or replicate it with DDP.

    ``train.precision=bf16`` computes in bf16 and reduces gradients in fp32; the weights
    and optimizer state stay fp32."""
    bf16 = cfg.train.precision == Precision.bf16
    if bf16 and runtime.device.type != "cuda":
        raise ConfigError(f"train.precision=bf16 needs CUDA (this run is on "
                          f"{runtime.device.type}); use train.precision=fp32")
    if cfg.train.tf32:
        if runtime.device.type != "cuda":
            raise ConfigError(f"train.tf32=true needs CUDA (this run is on "
                              f"{runtime.device.type}); use train.tf32=false")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if bf16 and cfg.distributed.parallelism != Parallelism.fsdp:
        raise ConfigError("train.precision=bf16 needs distributed.parallelism=fsdp (FSDP2's "
                          "mixed precision)")
    if cfg.train.activation_checkpointing:
        for unit in units:
            checkpoint_activations(unit)
    if cfg.train.compile:
        compile_units(units or [model], runtime.device)
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

    # DDP only: fully_shard moves each shard to the device itself, never the whole model.
    model.to(runtime.device)
    ids = [runtime.local_rank] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in the backward pass (non-reentrant, random state
    preserved). Wrapping only the forward keeps parameter names, and so checkpoints, as is."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def compile_units(units: list[nn.Module], device: torch.device) -> None:
    """``torch.compile`` each unit's forward in place (as torchtitan compiles each block):
    no ``_orig_mod.`` prefix, so checkpoints are the same compiled or not, and sharding
    and gradient-sync hooks stay outside the compiled code."""
    if device.type == "cpu" and not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        raise ConfigError("train.compile=true on the CPU needs a C++ compiler (g++ or "
                          "clang++) on the PATH; install one or use train.compile=false")
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError("train.compile=true on CUDA needs triton (pip install triton); "
                              "or use train.compile=false")
    for unit in units:
        unit.forward = torch.compile(unit.forward)


def set_gradient_sync(model: nn.Module, parallelism: Parallelism, enabled: bool) -> None:
    """Reduce gradients across ranks in the next backward pass, or only accumulate them."""
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
