"""What the harness tells the task besides its configuration: ``build_model(cfg, ctx)``.

It lives beside the configuration because it flows the same way, from the harness into
the task (task.py imports it for its type, and nothing else of the harness).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _cpu() -> torch.device:
    # torch imported here, not above: the config package is also what the commands that
    # only read settings (plan, goodput) import, and they stay free of torch.
    import torch

    return torch.device("cpu")


@dataclass(frozen=True)
class TaskContext:
    """What the harness tells the task about this run: ``build_model(cfg, ctx)``.

    ``first_start``: no committed checkpoint exists yet, so nothing will be loaded over
    the model (load pretrained weights now; a resume overwrites them anyway).
    """

    first_start: bool = True
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=_cpu)
