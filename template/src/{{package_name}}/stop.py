"""The stop protocol: every rank stops at the same step, then the state is saved in time.

Requests come from the preemption watch (signals, cloud notices). At each step boundary
the ranks ``vote`` with one small all-reduce, so that they all stop at the same step
even when only one of them was told. Once stopped, ``stop`` drains the save in flight
and writes a final checkpoint at this step if the grace period allows, deciding on rank
0 (it alone knows what committed) so that every rank joins the same save or none does.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .checkpoint.policy import SavePolicy, Vote
from .distributed import Runtime
from .metrics import Event, MetricsLog
from .preemption import PreemptionWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stopped:
    step: int
    final_step: int | None       # the checkpoint committed at the stop, if any
    resume_step: int | None      # where a restart resumes
    by_user: bool = False        # Ctrl-C, not a preemption


class StopCoordinator:
    def __init__(self, watch: PreemptionWatch, runtime: Runtime, metrics: MetricsLog,
                 grace_period_s: float) -> None:
        self.watch = watch
        self.runtime = runtime
        self.metrics = metrics
        self.grace_period_s = grace_period_s
        # Under torchrun the parent is the launcher; it must outlive its workers.
        self.launcher_pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None

    @property
    def requested(self) -> bool:
        return self.watch.requested is not None

    def vote(self, failed_saves: int = 0) -> Vote:
        """One small all-reduce at a step boundary, so that every rank decides alike.

        Carries the wall-clock time of the earliest stop request on any rank and the most
        failed saves on any rank. A worker whose launcher (torchrun) has gone asks for a
        stop here too: workers never train on as orphans.
        """
        if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
            self.watch.request("launcher-gone", f"the parent process {self.launcher_pid} "
                                                "(torchrun) has exited")
        request = self.watch.requested
        earliest = request.wall_time if request is not None else math.inf
        failed = float(failed_saves)
        if self.runtime.world_size > 1:
            tensor = torch.tensor([earliest, -failed], dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)  # MIN of -failed is -(the most)
            earliest, failed = float(tensor[0]), -float(tensor[1])
        return Vote(None if math.isinf(earliest) else earliest, int(failed))

    def any_rank(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true when it is true on any rank (one small all-reduce)."""
        if self.runtime.world_size == 1:
            return tuple(bool(f) for f in flags)
        tensor = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in tensor.tolist())

    def from_rank0(self, flag: bool) -> bool:
        """Rank 0's value of ``flag`` on every rank (rank 0 alone knows what committed)."""
        decision = torch.tensor([1 if flag else 0])
        if self.runtime.world_size > 1:
            dist.broadcast(decision, src=0)
        return bool(decision.item())

    def _agreed_source(self, step: int) -> tuple[str, int, str, list[int]]:
        """Source, rank and detail of the earliest request, and every rank's step.

        A collective, run once when stopping: rank 0 logs what reached another rank
        first, and the steps show that all ranks stopped at the same one.
        """
        request = self.watch.requested
        mine = ((request.wall_time, request.source, request.detail) if request is not None
                else (math.inf, "", "")) + (step,)
        every: list = [mine]
        if self.runtime.world_size > 1:
            every = [None] * self.runtime.world_size
            dist.all_gather_object(every, mine)
        rank = min(range(len(every)), key=lambda r: every[r][0])
        return every[rank][1], rank, every[rank][2], [entry[3] for entry in every]

    @staticmethod
    def _skip_reason(saves: SavePolicy, step: int, deadline: float, estimate: float,
                     drain_timed_out: bool) -> str | None:
        """Why no final checkpoint should be written at ``step`` (rank 0), or None."""
        newest = saves.newest_step
        if newest == step:
            return f"checkpoint at step {step} already committed"
        if newest is None and step == 0:
            return "no step trained yet"
        if drain_timed_out:
            return "finishing the save in flight used up the grace period"
        remaining = deadline - time.time()
        if remaining < estimate:
            return (f"{remaining:.2f} s of grace left, a save takes about {estimate:.2f} s "
                    f"(measured)")
        return None

    def stop(self, saves: SavePolicy, step: int, requested_at: float) -> Stopped:
        """Drain the in-flight save, then commit a final one at ``step`` if the grace allows.

        Time runs from the earliest request on any rank; the deadline is that plus the
        grace period. The drain gives up at the deadline; a final save that the measured
        save time says cannot fit is not started, and the newest committed checkpoint
        stays the one to resume from. Either way nothing torn can count: only a commit
        makes a checkpoint.
        """
        grace = self.grace_period_s
        deadline = requested_at + grace
        source, source_rank, detail, rank_steps = self._agreed_source(step)
        in_flight_step = saves.in_flight_step
        what = ("interrupted by the user (Ctrl-C; press it again to exit without a final save)"
                if source == "SIGINT" else source)
        what += f" on rank {source_rank}" if self.runtime.world_size > 1 else ""
        what += f": {detail}" if detail else ""
        draining = (f", finishing the save of step {in_flight_step} in flight"
                    if in_flight_step is not None else "")
        self.metrics.say(f"stop requested ({what}) at step {step}{draining}; "
                         f"grace period {grace:g} s")

        # 1. Drain: the save in flight commits, or fails (a signal sent to the process group
        #    also kills DCP's checkpoint process), or is given up at the deadline. A drain
        #    that ran out of time on any rank counts: rank 0 must not plan on time that
        #    rank lacks.
        drained, timed_out = saves.drain(timeout=deadline - time.time())
        committed_at = time.time() if drained is not None else None
        (drain_timed_out,) = self.any_rank(timed_out)

        # 2. Final save at this step, decided by rank 0.
        estimate = saves.save_estimate_s()
        skip = self._skip_reason(saves, step, deadline, estimate, drain_timed_out)
        final = None
        if self.from_rank0(skip is None):
            try:
                final = saves.save_now(step, "preemption")
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - still exit as preempted
                log.error("final checkpoint at step %d failed: %s", step, exc)
                skip = f"final save failed: {exc}"
            if final is not None:
                committed_at = time.time()

        finished = time.time()
        to_commit = committed_at - requested_at if committed_at is not None else None
        grace_left = deadline - finished
        resume_step = saves.newest_step
        self.metrics.event(
            Event.preemption, source=source, source_rank=source_rank, detail=detail,
            stop_step=step, rank_stop_steps=rank_steps, in_flight_step=in_flight_step,
            drained_step=drained.step if drained is not None else None,
            final_checkpoint_step=final.step if final is not None else None,
            final_save_skipped_reason=skip if final is None else None,
            save_estimate_s=estimate, signal_to_commit_s=to_commit,
            grace_period_s=grace, grace_left_s=grace_left, resume_step=resume_step,
            signals_received=self.watch.count)
        if final is not None:
            outcome = f"checkpoint step {step} committed {to_commit:.2f} s after the request"
        else:
            outcome = (f"no final checkpoint ({skip}); a restart resumes from "
                       f"{'step ' + str(resume_step) if resume_step is not None else 'scratch'}")
        left = (f"{grace_left:.1f} s of grace left" if grace_left >= 0
                else f"{-grace_left:.2f} s past the grace period")
        self.metrics.say(f"stopped at step {step}: {outcome}; {left}")
        if self.runtime.is_main and to_commit is not None and to_commit > grace:
            log.warning("the last commit came %.1f s after the request, past the %g s grace "
                        "period: where the platform kills on time it would have been lost",
                        to_commit, grace)
        return Stopped(step, final.step if final is not None else None, resume_step,
                       by_user=source == "SIGINT")
