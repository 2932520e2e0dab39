"""Adapters that present training state to DCP as ``Stateful`` objects.

DCP calls ``state_dict()`` when a save starts and ``load_state_dict()`` after a load has
filled the tensors in place: each adapter decides what its part looks like on disk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class Progress(Stateful):
    """Where training stands, in world-size-independent terms."""

    step: int = 0
    samples_consumed: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.samples_consumed = int(state_dict["samples_consumed"])


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None,
                   progress: Progress, rng: RankRNG | None) -> dict[str, Stateful]:
    """Everything a checkpoint holds, as DCP sees it: one key per part."""
    state = {"app": ModelAndOptimizer(model, optimizer), "progress": progress,
             "scheduler": Scheduler(scheduler) if scheduler is not None else None, "rng": rng}
    return {key: part for key, part in state.items() if part is not None}


class ModelAndOptimizer(Stateful):
    """Model and optimizer state, sharded as the model is (FSDP2) or replicated (DDP).

    ``get_state_dict`` (fully qualified names: loads into another world size or wrapper)
    walks every module, so its result, views of the live tensors, is reused while
    ``_layout`` holds; non-tensor values are read afresh each save (docs/PERFORMANCE.md)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._cached: tuple[tuple, dict[str, Any], dict[str, Any]] | None = None
        self.reused = 0   # saves that reused the names (a test counts them)

    def state_dict(self) -> dict[str, Any]:
        layout = self._layout()
        if self._cached is not None and self._cached[0] == layout \
                and self._refresh(self._cached[2]):
            _, model_state, optim_state = self._cached
            self.reused += 1
        else:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            self._cached = (layout, model_state, optim_state)
        return {"model": model_state, "optim": optim_state}

    def _layout(self) -> tuple:
        def ident(t: torch.Tensor) -> tuple:
            local = getattr(t, "_local_tensor", t)   # a DTensor's shard
            return (id(t), id(local), local.data_ptr(), tuple(local.shape))

        params = tuple(ident(p) for p in self.model.parameters())
        buffers = tuple(ident(b) for b in self.model.buffers())
        groups = tuple(tuple(id(p) for p in g["params"]) for g in self.optimizer.param_groups)
        state = tuple((id(p), tuple((k, ident(v) if isinstance(v, torch.Tensor) else type(v))
                                    for k, v in per_param.items()))
                      for p, per_param in self.optimizer.state.items())
        return params, buffers, groups, state

    def _refresh(self, optim_state: dict[str, Any]) -> bool:
        """Read the optimizer's non-tensor values into the kept result; False if misaligned."""
        saved_groups = optim_state["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups) or any(
                len(g["params"]) != len(s["params"])
                for g, s in zip(self.optimizer.param_groups, saved_groups)):
            return False
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            names = saved["params"]
            saved.clear()
            saved.update({k: v for k, v in group.items() if k != "params"}, params=names)
            for param, name in zip(group["params"], names):
                live, kept = self.optimizer.state.get(param), optim_state["state"].get(name)
                if live is not None and kept is not None:
                    kept.update((k, v) for k, v in live.items() if not isinstance(v, torch.Tensor))
        return True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class Scheduler(Stateful):
    """An LR scheduler; its lambdas are code, not state, and are left out."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state_dict})


class RankRNG(Stateful):
    """This rank's random number generators, under a key of its own (``rank<r>``): DCP
    keeps one copy of values saved under one key by several ranks."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.key = f"rank{rank}"
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return {self.key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[self.key]
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)
