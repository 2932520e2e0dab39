"""The default learning-rate schedule, a function of the ``train:`` keys alone.
The default optimizer (loop.task_contract) follows it; the checkpointer uses it to say what
a changed ``train.max_steps`` does to a resumed run."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_ratio``; a function of the global step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
