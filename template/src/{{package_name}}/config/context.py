"""What the harness tells the task besides its configuration: ``build_model(cfg, ctx)``.
Beside the configuration because it flows the same way, from the harness into the task
(task.py imports it for its type, and nothing else of the harness)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _cpu() -> torch.device:
    # torch imported here: the commands that only read settings (plan, goodput) stay free of it.
    import torch

    return torch.device("cpu")


@dataclass(frozen=True)
class TaskContext:
    """``first_start``: no committed checkpoint exists yet, so nothing will be loaded over
    the model (load pretrained weights now; a resume overwrites them anyway)."""

    first_start: bool = True
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=_cpu)
