"""The stop protocol: every rank stops at the same step.

Requests come from the preemption watch; at each step boundary the ranks ``vote`` with one
small all-reduce, so that they all stop at the same step even when only one was told. What
is saved at the stop is the checkpointer's decision (``checkpoint.policy``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.distributed import Runtime
from . import launcher
from .watch import PreemptionWatch


@dataclass(frozen=True)
class Vote:
    """What all ranks agreed at a step boundary."""

    stop_at: float | None   # wall time of the earliest stop request on any rank, or None
    failed_saves: int       # the most failed saves on any rank, this run


class StopCoordinator:
    def __init__(self, watch: PreemptionWatch, runtime: Runtime, grace_period_s: float) -> None:
        self.watch = watch
        self.runtime = runtime
        self.grace_period_s = grace_period_s
        # Under torchrun the parent is the launcher; it must outlive its workers.
        self.launcher_pid = launcher.launcher_pid()
        self.torchrun_pid = launcher.torchrun_pid()

    @property
    def requested(self) -> bool:
        return self.watch.requested is not None

    def vote(self, failed_saves: int = 0) -> Vote:
        """One small all-reduce at a step boundary: the earliest stop request and the most
        failed saves on any rank. A worker whose launcher (torchrun) is gone asks for a stop
        here too: workers never train on as orphans."""
        if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
            self.watch.request(launcher.SOURCE, launcher.describe(self.launcher_pid))
        request = self.watch.requested
        earliest = request.wall_time if request is not None else math.inf
        failed = float(failed_saves)
        if self.runtime.world_size > 1:
            tensor = torch.tensor([earliest, -failed], dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)  # MIN of -failed is -(the most)
            earliest, failed = float(tensor[0]), -float(tensor[1])
        return Vote(None if math.isinf(earliest) else earliest, int(failed))

    @property
    def signals_received(self) -> int:
        return self.watch.count

    def agreed_source(self, step: int) -> tuple[str, int, str, list[int]]:
        """Source, rank and detail of the earliest request, and every rank's step (to show
        they agree): a collective, run once when stopping."""
        request = self.watch.requested
        mine = ((request.wall_time, request.source, request.detail) if request is not None
                else (math.inf, "", "")) + (step,)
        every: list = [mine]
        if self.runtime.world_size > 1:
            every = [None] * self.runtime.world_size
            dist.all_gather_object(every, mine)
        rank = min(range(len(every)), key=lambda r: every[r][0])
        return every[rank][1], rank, every[rank][2], [entry[3] for entry in every]
