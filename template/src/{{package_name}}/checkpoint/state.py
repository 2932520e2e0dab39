"""Adapters that present training state to DCP as ``Stateful`` objects.

DCP calls ``state_dict()`` when a save starts and ``load_state_dict()`` after a load has
filled the tensors in place, so each adapter decides what its part looks like on disk.
"""

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
    state: dict[str, Stateful] = {"app": ModelAndOptimizer(model, optimizer),
                                  "progress": progress}
    if scheduler is not None:
        state["scheduler"] = Scheduler(scheduler)
    if rng is not None:
        state["rng"] = rng
    return state


class ModelAndOptimizer(Stateful):
    """Model and optimizer state, sharded as the model is (FSDP2) or replicated (DDP).

    ``get_state_dict`` gives fully qualified parameter names, so the same checkpoint
    loads into another world size or wrapper.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class Scheduler(Stateful):
    """An LR scheduler; its lambdas are code, not state, and are left out."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.scheduler.state_dict())
        state.pop("lr_lambdas", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state_dict})


class RankRNG(Stateful):
    """This rank's random number generators, under a key of its own.

    DCP keeps one copy of values saved under the same key by several ranks, so each
    rank's generator state needs its own key (``rank<r>``).
    """

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
