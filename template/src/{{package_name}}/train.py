"""Train, resuming from the newest complete checkpoint when there is one.

    torchrun --nproc-per-node 2 -m <package>.train [--config PATH] [key=value ...]
    python -m <package>.train [key=value ...]          (one process, no torchrun)

Exit status: 0 finished, ``preemption.exit_code`` (75 by default) stopped by a
preemption signal or notice (run again: the newest committed checkpoint holds the
state), 2 bad configuration or a task that breaks its contract, 1 crashed. See docs/PREEMPTION.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch.distributed as dist

from .checkpoint import CheckpointManager, open_storage
from .config import ConfigError, load_config
from .distributed import setup, teardown
from .metrics import MetricsLog
from .preemption import PreemptionWatch, start_notice_poller
from .sampling import BatchSizeError
from .stop import StopCoordinator
from .task_contract import load_task
from .trainer import TaskError, Trainer

EXIT_BAD_CONFIG = 2


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
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    watch = PreemptionWatch(cfg.preemption.signals)
    watch.install()  # before anything slow, so an early signal is not lost
    runtime = setup(cfg.distributed)
    # Cloud notices (preemption.notice_source) feed the same watch as signals.
    poller = start_notice_poller(cfg.preemption, watch, runtime.local_rank)
    metrics = MetricsLog(cfg.log.dir if runtime.is_main else None)
    manager = CheckpointManager(open_storage(cfg.checkpoint.dir), mode=cfg.checkpoint.async_mode,
                                keep_last=cfg.checkpoint.keep_last,
                                is_coordinator=runtime.is_main, device=runtime.device)
    stop = StopCoordinator(watch, runtime, metrics, cfg.preemption.grace_period_s)
    try:
        try:
            trainer = Trainer(cfg, load_task(), runtime, manager, stop, metrics)
        except (ConfigError, BatchSizeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        manager.prepare()
        resumed = trainer.resume(manager)
        metrics.event("start", step=trainer.progress.step, world_size=runtime.world_size,
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
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        # Rank 0 commits after the others are done writing: nobody leaves before it has,
        # or a launcher that ends the job on the first exit could cut the commit off.
        if runtime.world_size > 1:
            dist.barrier()
        if outcome.status == "preempted":
            metrics.say(f"exit status {cfg.preemption.exit_code}: preempted, run again to resume")
            return cfg.preemption.exit_code
        metrics.say(f"finished at step {outcome.step}")
        return 0
    finally:
        if poller is not None:
            poller.stop()
        metrics.close()
        teardown()
        # Last: a signal that comes while shutting down is only counted, never kills.
        watch.uninstall()


if __name__ == "__main__":
    sys.exit(main())
