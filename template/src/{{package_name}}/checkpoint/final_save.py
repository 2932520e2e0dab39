"""The stop: the save in flight drained, then a final checkpoint at the stop step if the
grace period allows (a stop is one more reason to save, as in Orbax's preemption policy).

``SavePolicy.decide`` calls ``stop`` once all ranks voted to stop at a step boundary; the
decisions and figures: docs/RESUMING.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch.distributed.checkpoint.api import CheckpointException

from ..preemption.stop import Vote
from ..runtime.distributed import any_rank, decide_on_rank0
from ..runtime.metrics import Event

if TYPE_CHECKING:
    from .policy import SavePolicy

log = logging.getLogger(__name__)


class StepBoundary(Protocol):
    """The stop protocol as the save policy sees it (preemption.stop.StopCoordinator)."""

    grace_period_s: float

    @property
    def requested(self) -> bool: ...
    def vote(self, failed_saves: int = 0) -> Vote: ...
    def agreed_source(self, step: int) -> tuple[str, int, str, list[int]]: ...
    @property
    def signals_received(self) -> int: ...


@dataclass(frozen=True)
class Stopped:
    step: int
    final_step: int | None       # the checkpoint committed at the stop, if any
    resume_step: int | None      # where a restart resumes
    by_user: bool = False        # Ctrl-C, not a preemption


def _skip_reason(newest: int | None, step: int, deadline: float, estimate: float,
                 drain_timed_out: bool) -> str | None:
    """Why no final checkpoint should be written at ``step`` (rank 0), or None."""
    if newest == step:
        return f"checkpoint at step {step} already committed"
    if newest is None and step == 0:
        return "no step trained yet"
    if drain_timed_out:
        return "finishing the save in flight used up the grace period"
    if (remaining := deadline - time.time()) < estimate:
        return f"{remaining:.2f} s of grace left, a save takes about {estimate:.2f} s (measured)"
    return None


def stop(policy: SavePolicy, step: int, requested_at: float, boundary: StepBoundary) -> Stopped:
    """Drain the in-flight save, then commit a final one at ``step`` if the grace allows:
    the deadline is the earliest request on any rank plus the grace period, and a final
    save the measured save time says cannot fit is not started."""
    grace = boundary.grace_period_s
    deadline = requested_at + grace
    source, source_rank, detail, rank_steps = boundary.agreed_source(step)
    in_flight_step = policy.pipeline.in_flight_step
    what = ("interrupted by the user (Ctrl-C; press it again to exit without a final save)"
            if source == "SIGINT" else source)
    what += f" on rank {source_rank}" if len(rank_steps) > 1 else ""
    what += f": {detail}" if detail else ""
    draining = (f", finishing the save of step {in_flight_step} in flight"
                if in_flight_step is not None else "")
    policy.metrics.say(f"stop requested ({what}) at step {step}{draining}; "
                     f"grace period {grace:g} s")

    # 1. Drain: the save in flight commits, fails (a signal to the process group also kills
    #    DCP's checkpoint process) or is given up at the deadline. A drain that ran out of
    #    time on any rank counts: rank 0 must not plan on time that rank lacks.
    drained, timed_out = policy.drain(timeout=deadline - time.time())
    committed_at = time.time() if drained is not None else None
    (drain_timed_out,) = any_rank(timed_out)

    # 2. Final save at this step, decided by rank 0.
    estimate = policy.save_estimate_s()
    newest = policy.newest_step
    skip = decide_on_rank0(lambda: _skip_reason(newest, step, deadline, estimate, drain_timed_out))
    final = None
    if skip is None:
        try:
            final = policy.save_now(step, "preemption")
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - still exit as preempted
            log.error("final checkpoint at step %d failed: %s", step, exc)
            skip = f"final save failed: {exc}"
        if final is not None:
            committed_at = time.time()

    to_commit = committed_at - requested_at if committed_at is not None else None
    grace_left = deadline - time.time()
    resume_step = policy.newest_step
    policy.metrics.event(
        Event.preemption, source=source, source_rank=source_rank, detail=detail,
        stop_step=step, rank_stop_steps=rank_steps, in_flight_step=in_flight_step,
        drained_step=drained.step if drained is not None else None,
        final_checkpoint_step=final.step if final is not None else None,
        final_save_skipped_reason=skip if final is None else None,
        save_estimate_s=estimate, signal_to_commit_s=to_commit,
        grace_period_s=grace, grace_left_s=grace_left, resume_step=resume_step,
        signals_received=boundary.signals_received)
    resumes = f"step {resume_step}" if resume_step is not None else "scratch"
    outcome = (f"checkpoint step {step} committed {to_commit:.2f} s after the request"
               if final is not None
               else f"no final checkpoint ({skip}); a restart resumes from {resumes}")
    left = (f"{grace_left:.1f} s of grace left" if grace_left >= 0
            else f"{-grace_left:.2f} s past the grace period")
    policy.metrics.say(f"stopped at step {step}: {outcome}; {left}")
    if to_commit is not None and to_commit > grace:
        log.warning("the last commit came %.1f s after the request, past the %g s grace "
                    "period: where the platform kills on time it would have been lost",
                    to_commit, grace)
    return Stopped(step, final.step if final is not None else None, resume_step,
                   by_user=source == "SIGINT")
