"""Train, resuming from the newest complete checkpoint when there is one.

    torchrun --nproc-per-node 2 -m <package>.train [--config PATH] [key=value ...]
    python -m <package>.train [key=value ...]          (one process, no torchrun)

Exit status: 0 finished, ``preemption.exit_code`` (75) preempted, 130 interrupted, 73 the
last state not saved, 79 no progress, 2 bad configuration or a task that breaks its
contract, 1 crashed, 124 this rank's watchdog found a hung step (docs/PREEMPTION.md, "Exit
status"). A status training decided (all but 1 and 124) ends the job instead of an in-place
restart; ``resume`` reports it from the ``end`` event (docs/RECOVERY.md, "In-place restarts").
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
from typing import Any

import torch.distributed as dist

from .. import PACKAGE
from ..checkpoint import Checkpointer, CheckpointUnusable, Committed, IncompatibleCheckpoint
from ..checkpoint.save.background import quiet_checkpoint_process_exit, stop_background_processes
from ..config import Config, ConfigError, NoticeSource, load_config, to_plain_dict
from ..ledger.history import HistorySink
from ..preemption.launcher import LauncherWatch
from ..preemption.stop import StopCoordinator
from ..preemption.watch import PreemptionWatch, effective_grace_s
from ..recovery.attempts import FAILURES, Attempt, cause, gather_previous
from ..recovery.progress_guard import ProgressGuard
from ..recovery.watchdog import StepWatchdog
from ..runtime import exit_codes, phases
from ..runtime.distributed import (
    BackendUnavailable,
    Runtime,
    decide_on_rank0,
    highest,
    setup,
    teardown,
)
from ..runtime.exit_codes import Refused, error_line, refusals, refuse
from ..runtime.metrics import Event, MetricsLog, append_event
from ..runtime.phases import Phase
from ..runtime.torch_compat import torch_too_old
from .sampling import BatchSizeError
from .task_contract import load_task
from .trainer import TaskError, Trainer

# How long a rank other than local rank 0 waits for torchrun's SIGTERM (_no_restart_in_place).
ASK_WAIT_S = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.train",
        description="Train with asynchronous sharded checkpoints; resumes automatically.",
        epilog="Overrides are key=value pairs, e.g. train.max_steps=500 checkpoint.dir=/ckpt")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


@refusals
def main(argv: list[str] | None = None) -> int:
    phases.mark(Phase.imports_done)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # torch's own INFO chatter stays off the console
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or "torch" not in r.pathname)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        raise Refused(exc) from exc
    if (too_old := torch_too_old()) is not None:
        raise Refused(too_old)

    watch = PreemptionWatch(cfg.preemption.signals)
    watch.install()  # before anything slow, so an early signal is not lost
    quiet_checkpoint_process_exit()
    # A fatal error (a segmentation fault) prints every thread's stack, where stderr has a fd.
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.enable(all_threads=True)
    try:
        runtime = setup(cfg.distributed.backend, cfg.recovery.collective_timeout_s)
    except BackendUnavailable as exc:
        raise Refused(exc) from exc
    phases.mark(Phase.rendezvous_done)
    # How the previous start ended, on every rank, before this one writes its own record.
    attempt = Attempt(cfg.log.dir, runtime.rank)
    previous = cause(gather_previous(attempt, runtime.world_size))
    attempt.job_restart = highest(attempt.restart)
    attempt.begin()
    # Cloud notices (preemption.notice_source) feed the same watch as signals.
    poller = None
    if cfg.preemption.notice_source != NoticeSource.none:   # rendered with a cloud answer
        from ..preemption.notices import start_notice_poller
        poller = start_notice_poller(cfg.preemption, watch, runtime.local_rank)
    metrics = MetricsLog(cfg.log.dir if runtime.is_main else None)
    grace = effective_grace_s(cfg.preemption)
    if grace < cfg.preemption.grace_period_s:
        metrics.say(f"notice: preemption.grace_period_s={cfg.preemption.grace_period_s:g} is "
                    f"longer than {cfg.preemption.notice_source.value}'s notice window; the "
                    f"final save is planned against {grace:g} s")
    stop = StopCoordinator(watch, runtime, grace)
    # A launcher that dies (torchrun without --signals-to-handle, on a SIGUSR1) is seen
    # within a second; past the grace period this worker ends itself, children first.
    orphan_guard = (LauncherWatch(watch, stop.launcher_pid, grace,
                                  status=lambda: exit_codes.NOT_SAVED).start()
                    if stop.launcher_pid is not None else None)
    watchdog = _watchdog(cfg, runtime, attempt)
    checkpointer: Checkpointer | None = None
    try:
        try:
            checkpointer = Checkpointer.open(cfg, runtime, metrics, stop, allow=watchdog.allow,
                                             continues=previous is not None)
            code, reason = _train(cfg, runtime, checkpointer, stop, watchdog, metrics, attempt,
                                  previous)
        except Refused as exc:   # CheckpointRefused, or _train's refusals
            code, reason = refuse(exc), str(exc)
        except BaseException as exc:
            attempt.crashed(exc)
            metrics.event(Event.end, status=exit_codes.FAILED,
                          reason=f"crashed: {error_line(exc)}", restart=attempt.job_restart)
            raise
        decided_at = time.time()
        attempt.ended(code, reason)
        metrics.event(Event.end, status=code, reason=reason, restart=attempt.job_restart)
        _no_restart_in_place(code, stop, runtime, attempt, decided_at)
    finally:
        if poller is not None:
            poller.stop()
        abandoned = checkpointer.release() if checkpointer is not None else False
        metrics.close()
        if abandoned:
            # A given-up background save may wait on a dead peer for half an hour: leave
            # now with the status decided, and take no child along.
            sys.stdout.flush()
            sys.stderr.flush()
            stop_background_processes()
            os._exit(code if "code" in locals() else exit_codes.FAILED)
        teardown()
        if orphan_guard is not None:
            orphan_guard.stop()
        # Last: a signal that comes while shutting down is only counted, never kills.
        watch.uninstall()
    return code


def _no_restart_in_place(code: int, stop: StopCoordinator, runtime: Runtime,
                         attempt: Attempt, decided_at: float) -> None:
    """Ask torchrun to stop (SIGTERM) rather than restart in place on a decided status.

    Local rank 0 asks, once per node, before its clean-up (its handler still counts the
    SIGTERM sent back); the other ranks wait for that SIGTERM first, as a rank that exited
    first would look like a crash. Skipped when torchrun has no restart left, is gone, or
    was signalled before the decision (it is stopping already).
    """
    launcher = stop.launcher_pid
    if (code == exit_codes.OK or launcher is None or os.getppid() != launcher
            or attempt.restarts_left == 0):
        return
    if (request := stop.watch.requested) is not None and request.source.startswith("SIG") \
            and request.wall_time <= decided_at:
        return
    if runtime.local_rank != 0:
        heard, deadline = stop.signals_received, time.monotonic() + ASK_WAIT_S
        while stop.signals_received == heard and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    print(f"exit status {code} was decided by training, not a failure: asking torchrun "
          f"(pid {stop.torchrun_pid}) to stop instead of restarting the workers in place "
          "(under plain torchrun, its SignalException below is that)", file=sys.stderr,
          flush=True)
    os.kill(stop.torchrun_pid, signal.SIGTERM)


def _guard_progress(cfg: Config, checkpointer: Checkpointer, attempt: Attempt,
                    previous: dict[str, Any] | None) -> tuple[int, str | None]:
    """Rank 0's no-progress verdict: failed starts in a row, and why this start must not
    run (None: it may). Progress: a newer committed or memory-copy step to restart from."""
    step = checkpointer.newest_recoverable_step()
    attempt.begin(newest_step=-1 if step is None else step)  # the next start compares
    return ProgressGuard(checkpointer.storage,
                         cfg.recovery.max_attempts_without_progress).on_start(step, previous)


def _train(cfg: Config, runtime: Runtime, checkpointer: Checkpointer, stop: StopCoordinator,
           watchdog: StepWatchdog, metrics: MetricsLog, attempt: Attempt,
           previous: dict[str, Any] | None) -> tuple[int, str]:
    """The exit status and why; Refused for a broken task contract or unusable checkpoint."""
    failed_starts, no_progress = decide_on_rank0(
        lambda: _guard_progress(cfg, checkpointer, attempt, previous))
    if no_progress is not None:
        if runtime.is_main:
            refuse(Refused(no_progress, exit_codes.NO_PROGRESS))
        metrics.say(f"exit status {exit_codes.NO_PROGRESS}: do not retry")
        return exit_codes.NO_PROGRESS, no_progress
    try:
        trainer = Trainer(cfg, load_task(), runtime, checkpointer, metrics, watchdog,
                          stop_requested=lambda: stop.requested)
    except (ConfigError, BatchSizeError) as exc:
        raise Refused(exc) from exc
    phases.mark(Phase.model_built)
    attempt.progress = trainer.progress
    try:
        resumed = trainer.resume()
    except (IncompatibleCheckpoint, CheckpointUnusable) as exc:
        raise Refused(exc) from exc
    refused = decide_on_rank0(lambda: _attach_trackers(cfg, checkpointer, metrics, resumed))
    if refused is not None:
        raise Refused(refused)
    failed = previous is not None and previous["kind"] in FAILURES
    failed_at = previous.get("failed_at") if failed else None
    if runtime.is_main:   # this start's record in the interruption history (ledger/)
        metrics.sinks.append(HistorySink(checkpointer.storage, cfg.preemption.exit_code,
                                         previous))
    metrics.event(Event.start, step=trainer.progress.step, world_size=runtime.world_size,
                  grad_accum_steps=trainer.split.grad_accum_steps,
                  resumed_from=resumed.path if resumed else None,
                  resumed_tier=resumed.tier if resumed else None,
                  saved_world_size=resumed.world_size if resumed else None,
                  restart=attempt.job_restart, max_restarts=attempt.max_restarts,
                  cause=previous, failed_starts=failed_starts,
                  failure_to_start_s=time.time() - failed_at if failed_at else None)
    if failed:
        how = (f"restart {attempt.job_restart} of {attempt.max_restarts} in place" if
               attempt.in_place else "start")
        metrics.say(f"{how} after a failure: {previous['summary']}")
    metrics.say(
        f"{'resumed from ' + resumed.path if resumed else 'starting fresh'}: step "
        f"{trainer.progress.step}, {runtime.world_size} rank(s) on {runtime.device.type}, "
        f"gradient accumulation {trainer.split.grad_accum_steps}, "
        f"checkpoints every {cfg.checkpoint.interval_steps} steps to {cfg.checkpoint.dir}")
    if (missing_eval := trainer.evaluator.missing()) is not None:
        metrics.say(missing_eval)
    trainer.on_first_step = lambda step: _first_step(metrics, attempt, previous, step, failed)
    try:
        outcome = trainer.run()
    except TaskError as exc:
        raise Refused(exc) from exc
    # Nobody leaves before rank 0 commits: a launcher ending the job at the first exit would cut it.
    if runtime.world_size > 1:
        dist.barrier()
    if outcome.status == "interrupted":
        metrics.say(f"interrupted by the user at step {outcome.step}; exit status "
                    f"{exit_codes.INTERRUPTED}: run again to resume")
        return exit_codes.INTERRUPTED, "interrupted by the user"
    if outcome.status == "preempted":
        metrics.say(f"exit status {cfg.preemption.exit_code}: preempted, run again to resume")
        return cfg.preemption.exit_code, "preempted"
    if outcome.status == "not_saved":
        reason = f"stopped at step {outcome.step} with its state NOT saved: {outcome.detail}"
        metrics.say(f"{reason}; exit status {exit_codes.NOT_SAVED}: fix the storage and run "
                    "again to resume")
        return exit_codes.NOT_SAVED, reason
    metrics.say(f"finished at step {outcome.step}")
    return exit_codes.OK, "finished"


def _attach_trackers(cfg: Config, checkpointer: Checkpointer, metrics: MetricsLog,
                     resumed: Committed | None) -> str | None:
    """Rank 0: log.trackers follow every event, continuing the checkpoint directory's run;
    why they cannot, or None (rendered with the copier answer trackers: config/parts.py)."""
    if not cfg.log.trackers:
        return None
    from ..tracking.trackers import open_trackers
    try:
        metrics.sinks += open_trackers(cfg.log.trackers, cfg.log.dir, checkpointer.storage,
                                       resumed.step if resumed is not None else None,
                                       to_plain_dict(cfg))
    except ConfigError as exc:
        return str(exc)
    return None


def _first_step(metrics: MetricsLog, attempt: Attempt, previous: dict[str, Any] | None,
                step: int, failed: bool) -> None:
    """The first step of this start: its phases, and after a failure what it cost."""
    phases.mark(Phase.first_step)
    for row in phases.timeline(previous if failed else None):
        metrics.event(Event.phase, step=step, restart=attempt.job_restart, **row)
    if not failed:
        return
    seconds = time.time() - previous["failed_at"] if previous.get("failed_at") else None
    metrics.event(Event.recovered, step=step, restart=attempt.job_restart,
                  in_place=attempt.in_place, cause_kind=previous["kind"],
                  failure_to_first_step_s=seconds)
    if seconds is not None:
        metrics.say(f"recovered: step {step} done {seconds:.1f} s after the failure"
                    f"{' (restarted in place)' if attempt.in_place else ''}")


def _watchdog(cfg: Config, runtime: Runtime, attempt: Attempt) -> StepWatchdog:
    def on_hang(step: int | None, waited_s: float, bound_s: float) -> None:
        attempt.hung(waited_s, bound_s)
        append_event(cfg.log.dir, Event.hang, rank=runtime.rank, step=step,
                     waited_s=waited_s, timeout_s=bound_s, restart=attempt.job_restart)
        stop_background_processes()   # os._exit follows: leave no child behind

    return StepWatchdog(rank=runtime.rank, step_timeout_s=cfg.recovery.step_timeout_s,
                        first_step_timeout_s=cfg.recovery.first_step_timeout_s, on_hang=on_hang)
