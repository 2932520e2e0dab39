"""Stragglers: which rank makes all the others wait.

In data parallelism every rank waits for the slowest one at each collective, so every
rank measures the same step time, the straggler's: step times cannot say who it is.
What a rank does alone can: waiting for its input (the data loader) and updating its
shard of the weights (the optimizer step, no collective inside). Each rank records
that "own time" per step; every ``recovery.straggler_every_steps`` steps the ranks
all-gather its median over those steps (one all-gather of two numbers), and a rank
whose median exceeds the median of all ranks by more than ``recovery.straggler_ratio``,
and by at least 5 % of the step time (a difference under that costs too little to
report), gets a ``straggler`` event and a warning line from rank 0.

On CUDA the optimizer step is timed with CUDA events (read at the check, no
synchronisation per step); the input wait is host time everywhere.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.distributed import Runtime
from ..runtime.metrics import Event, MetricsLog

MIN_SHARE_OF_STEP = 0.05  # a straggler must cost at least this share of a step


def find_stragglers(own_s: list[float], step_s: float, ratio: float) -> list[int]:
    """The ranks whose own time exceeds ``ratio`` x the median over ranks, by at least
    ``MIN_SHARE_OF_STEP`` of the step time."""
    median = statistics.median(own_s)
    return [rank for rank, own in enumerate(own_s)
            if own > ratio * median and own - median >= MIN_SHARE_OF_STEP * step_s]


class StragglerCheck:
    def __init__(self, *, every_steps: int, ratio: float, runtime: Runtime,
                 metrics: MetricsLog) -> None:
        self.every_steps = every_steps
        self.ratio = ratio
        self.runtime = runtime
        self.metrics = metrics
        self.cuda = runtime.device.type == "cuda"
        self._input_s = 0.0
        self._optimizer: list[Any] = []     # this step's timings (floats, or CUDA event pairs)
        self._own: list[tuple[float, Any]] = []   # (host seconds, optimizer timings) per step
        self._steps: list[float] = []
        self.found: list[dict[str, Any]] = []

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    # ----------------------------------------------------- within a step --
    def add_input(self, seconds: float) -> None:
        self._input_s += seconds

    @contextlib.contextmanager
    def optimizer(self) -> Iterator[None]:
        """Time the optimizer step (this rank's own compute)."""
        if not self.enabled:
            yield
            return
        if self.cuda:
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            yield
            end.record()
            self._optimizer.append((begin, end))
        else:
            began = time.perf_counter()
            yield
            self._optimizer.append(time.perf_counter() - began)

    def step_done(self, step_time_s: float) -> None:
        if self.enabled:
            self._own.append((self._input_s, self._optimizer))
            self._steps.append(step_time_s)
        self._input_s, self._optimizer = 0.0, []

    # ----------------------------------------------------------- the check --
    def due(self, step: int) -> bool:
        return self.enabled and step % self.every_steps == 0 and bool(self._own)

    def _own_seconds(self) -> list[float]:
        own = []
        for input_s, timings in self._own:
            seconds = input_s
            for timing in timings:
                if isinstance(timing, tuple):
                    timing[1].synchronize()
                    seconds += timing[0].elapsed_time(timing[1]) / 1000
                else:
                    seconds += timing
            own.append(seconds)
        return own

    def check(self, step: int) -> list[dict[str, Any]]:
        """Compare the ranks (a collective: every rank calls it at the same step).

        Returns the stragglers found (rank 0 also logs them); starts a new window.
        """
        mine = torch.tensor([statistics.median(self._own_seconds()),
                             statistics.median(self._steps)], dtype=torch.float64)
        self._own, self._steps = [], []
        rows = [mine]
        if self.runtime.world_size > 1:
            rows = [torch.zeros_like(mine) for _ in range(self.runtime.world_size)]
            dist.all_gather(rows, mine)
        own = [float(row[0]) for row in rows]
        step_s = statistics.median(float(row[1]) for row in rows)
        median = statistics.median(own)
        found = []
        for rank in find_stragglers(own, step_s, self.ratio):
            event = {"step": step, "rank": rank, "own_s": own[rank], "median_own_s": median,
                     "ratio": own[rank] / median if median > 0 else None,
                     "step_time_s": step_s, "ranks_own_s": own,
                     "window_steps": self.every_steps}
            found.append(event)
            self.metrics.event(Event.straggler, **event)
            times = f"{own[rank] / median:.1f}x" if median > 0 else "far more than"
            self.metrics.say(
                f"warning: rank {rank} is a straggler: its own part of a step (input + "
                f"optimizer) took {own[rank]:.3f} s against a median of {median:.3f} s over "
                f"the ranks ({times}), median of steps {self.every_steps} up to {step}; "
                f"every rank waits for it, about {own[rank] - median:.3f} s of each "
                f"{step_s:.3f} s step")
        self.found += found
        return found
