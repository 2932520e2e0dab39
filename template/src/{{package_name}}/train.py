"""Train, resuming from the newest complete checkpoint when there is one.

    torchrun --nproc-per-node 2 -m <package>.train [--config PATH] [key=value ...]
    python -m <package>.train [key=value ...]          (one process, no torchrun)

Exit status: 0 finished, ``preemption.exit_code`` (75 by default) stopped by a
preemption signal or notice (run again: the newest committed checkpoint holds the
state), 73 the last state is not saved (the final checkpoint, or saves in a row,
failed: fix the storage and run again), 2 bad configuration or a task that breaks its
contract, 1 crashed. See docs/PREEMPTION.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch.distributed as dist

from . import exit_codes
from .checkpoint import CheckpointManager, open_storage
from .checkpoint.background import stop_background_processes
from .checkpoint.layout import check_storage
from .checkpoint.lease import Lease, LeaseHeld
from .checkpoint.storage import StorageError
from .config import Config, ConfigError, load_config
from .distributed import Runtime, setup, teardown
from .metrics import Event, MetricsLog
from .preemption import PreemptionWatch, effective_grace_s, start_notice_poller
from .sampling import BatchSizeError
from .stop import StopCoordinator
from .task_contract import load_task
from .trainer import CheckpointUnusable, IncompatibleCheckpoint, TaskError, Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.train",
        description="Train with asynchronous sharded checkpoints; resumes automatically.",
        epilog="Overrides are key=value pairs, e.g. train.max_steps=500 checkpoint.dir=/ckpt",
    )
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # torch's own INFO chatter stays off the console
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or "torch" not in r.pathname)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.BAD_INPUT

    watch = PreemptionWatch(cfg.preemption.signals)
    watch.install()  # before anything slow, so an early signal is not lost
    runtime = setup(cfg.distributed)
    # Cloud notices (preemption.notice_source) feed the same watch as signals.
    poller = start_notice_poller(cfg.preemption, watch, runtime.local_rank)
    metrics = MetricsLog(cfg.log.dir if runtime.is_main else None)
    storage = open_storage(cfg.checkpoint.dir)
    lease = (Lease(storage, stale_s=cfg.checkpoint.lease_stale_s,
                   wait_s=cfg.checkpoint.lease_wait_s) if runtime.is_main else None)
    manager = CheckpointManager(storage, mode=cfg.checkpoint.async_mode,
                                keep_last=cfg.checkpoint.keep_last,
                                is_coordinator=runtime.is_main, device=runtime.device, lease=lease,
                                verify=cfg.checkpoint.verify)
    grace = effective_grace_s(cfg.preemption)
    if grace < cfg.preemption.grace_period_s:
        metrics.say(f"notice: preemption.grace_period_s={cfg.preemption.grace_period_s:g} is "
                    f"longer than {cfg.preemption.notice_source.value}'s notice window; the "
                    f"final save is planned against {grace:g} s")
    stop = StopCoordinator(watch, runtime, metrics, grace)
    try:
        code, reason = _train(cfg, runtime, manager, stop, metrics)
        metrics.event(Event.end, status=code, reason=reason)
    finally:
        if poller is not None:
            poller.stop()
        if lease is not None:
            lease.release()
        metrics.close()
        if manager.abandoned:
            # A background save was given up: its thread may wait on a dead peer for half
            # an hour. Leave now, with the status decided, and take no child along.
            sys.stdout.flush()
            sys.stderr.flush()
            stop_background_processes()
            os._exit(code if "code" in locals() else exit_codes.FAILED)
        teardown()
        # Last: a signal that comes while shutting down is only counted, never kills.
        watch.uninstall()
    return code


def _refuse(reason: object) -> tuple[int, str]:
    print(f"error: {reason}", file=sys.stderr)
    return exit_codes.BAD_INPUT, str(reason)


def _train(cfg: Config, runtime: Runtime, manager: CheckpointManager, stop: StopCoordinator,
           metrics: MetricsLog) -> tuple[int, str]:
    """Train; returns the exit status and, for the log, why."""
    try:  # before the lease and the model: a full or read-only checkpoint.dir fails now
        check_storage(manager.storage, cfg.checkpoint.keep_last, is_coordinator=runtime.is_main)
    except StorageError as exc:
        return _refuse(exc)
    refused = _take_lease(manager.lease, runtime)
    if refused:
        return _refuse(refused)
    try:
        trainer = Trainer(cfg, load_task(), runtime, manager, stop, metrics)
    except (ConfigError, BatchSizeError) as exc:
        return _refuse(exc)
    manager.prepare()
    try:
        resumed = trainer.resume(manager)
    except (IncompatibleCheckpoint, CheckpointUnusable) as exc:
        return _refuse(exc)
    metrics.event(Event.start, step=trainer.progress.step, world_size=runtime.world_size,
                  grad_accum_steps=trainer.split.grad_accum_steps,
                  resumed_from=resumed.path if resumed else None,
                  saved_world_size=resumed.world_size if resumed else None)
    metrics.say(
        f"{'resumed from ' + resumed.path if resumed else 'starting fresh'}: step "
        f"{trainer.progress.step}, {runtime.world_size} rank(s) on {runtime.device.type}, "
        f"gradient accumulation {trainer.split.grad_accum_steps}, "
        f"checkpoints every {cfg.checkpoint.interval_steps} steps to {cfg.checkpoint.dir}")
    try:
        outcome = trainer.run()
    except TaskError as exc:
        return _refuse(exc)
    # Rank 0 commits after the others are done writing: nobody leaves before it has,
    # or a launcher that ends the job on the first exit could cut the commit off.
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
        newest = trainer.saves.newest_step
        reason = (f"stopped at step {outcome.step} with its state NOT saved: {outcome.detail}; "
                  "the newest committed checkpoint is "
                  f"{'step ' + str(newest) if newest is not None else 'none'}")
        metrics.say(f"{reason}; exit status {exit_codes.NOT_SAVED}: fix the storage and run "
                    "again to resume")
        return exit_codes.NOT_SAVED, reason
    metrics.say(f"finished at step {outcome.step}")
    return exit_codes.OK, "finished"


def _take_lease(lease: Lease | None, runtime: Runtime) -> str | None:
    """Rank 0 takes the checkpoint directory's lease; every rank learns whether it may go on."""
    refused = [None]
    if lease is not None:
        try:
            notice = lease.acquire()
        except LeaseHeld as exc:
            refused[0] = str(exc)
        else:
            if notice:
                print(f"notice: {notice}", flush=True)
            lease.start_heartbeat()
    if runtime.world_size > 1:
        dist.broadcast_object_list(refused, src=0)
    return refused[0]


if __name__ == "__main__":
    sys.exit(main())
