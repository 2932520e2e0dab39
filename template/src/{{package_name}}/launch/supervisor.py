"""Restart training from the newest complete checkpoint, on this or another number of GPUs.

``python -m <package>.resume [options] [key=value ...]`` (``--help``) skips damaged
checkpoints, prints what changes, and runs torchrun with the training command, so a
restart is always the same line (docs/RESUMING.md). Exit statuses: docs/PREEMPTION.md;
torchrun's status becomes one in ``launch/verdict.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import PACKAGE
from ..checkpoint import Committed, newest_complete_checkpoint, open_storage
from ..checkpoint.store.layout import check_storage
from ..checkpoint.store.lease import Lease, LeaseHeld, scheduler_job_id
from ..checkpoint.store.outage import command_failure, with_retries
from ..checkpoint.store.storage import Storage
from ..config import (
    Config,
    ConfigError,
    PreemptionConfig,
    RecoveryConfig,
    VerifyMode,
    load_config,
    to_plain_dict,
)
from ..interval.inputs import configured_inputs
from ..ledger.advice import mtbi_notice
from ..loop.sampling import BatchSizeError, split_global_batch
from ..loop.task_contract import build_on_meta, check_config, load_task
from ..preemption import early
from ..runtime import exit_codes, phases
from ..runtime.exit_codes import Refused, refusals
from ..runtime.torch_compat import torch_too_old
from . import reaper
from .agent import watched
from .torchrun import DEFAULT_RDZV_ID, positive_int, rdzv_conf, shutdown_timeout_s, torchrun_command
from .verdict import (
    exit_status,
    node_lost_since,
    preemption_logged_since,
    say,
    stopped_before_launch,
    training_status_since,
)
from .warm import ZYGOTE_ENV
from .zygote import Started

# Forwarded even when preemption.signals omits them: Ctrl-C and schedulers' end signals.
ALWAYS_FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1")


@dataclass(frozen=True)
class ResumePoint:
    """Where training resumes and how the global batch is split on the new world size."""

    step: int
    checkpoint: str | None
    saved_world_size: int | None
    saved_grad_accum_steps: int | None
    world_size: int
    grad_accum_steps: int
    global_batch_size: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def describe(self, micro_batch_size: int, checkpoint_dir: str) -> str:
        now = (f"{self.world_size} rank(s) x micro-batch {micro_batch_size} x gradient "
               f"accumulation {self.grad_accum_steps} = global batch {self.global_batch_size}")
        if self.checkpoint is None:
            return f"resume: no complete checkpoint in {checkpoint_dir}: starting fresh on {now}"
        return (f"resume: step {self.step} from {self.checkpoint}\n"
                f"  saved on {self.saved_world_size} rank(s), gradient accumulation "
                f"{self.saved_grad_accum_steps}\n  now {now}")


def resume_point(cfg: Config, checkpoint: Committed | None, world_size: int) -> ResumePoint:
    """Where ``world_size`` ranks resume; raises BatchSizeError when the batch cannot split."""
    split = split_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size,
                               world_size)
    record = checkpoint.record if checkpoint is not None else {}
    return ResumePoint(
        step=checkpoint.step if checkpoint is not None else 0,
        checkpoint=checkpoint.path if checkpoint is not None else None,
        saved_world_size=record.get("world_size"),
        saved_grad_accum_steps=record.get("grad_accum_steps"),
        world_size=world_size,
        grad_accum_steps=split.grad_accum_steps,
        global_batch_size=split.global_batch_size,
    )


def _refuse_another_models_checkpoint(cfg: Config, storage: Storage,
                                     checkpoint: Committed) -> None:
    """Raise ValueError when the checkpoint's model is not this configuration's (unless its
    ``model:`` settings match, the model is built on the meta device for its shapes)."""
    if checkpoint.record.get("config", {}).get("model") == to_plain_dict(cfg).get("model"):
        return
    from ..checkpoint.load import compat  # DCP's reader: imported only when it is needed

    task = load_task()
    model = build_on_meta(lambda: task.build_model(cfg))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        saved = compat.saved_model_shapes(storage, checkpoint.name)
    except (OSError, RuntimeError):
        return  # unreadable: training falls back to an older checkpoint and says so
    differences = compat.differences(saved, shapes, checkpoint.record.get("config", {}).get(
        "model"), cfg.model)
    if differences:
        raise ValueError(f"checkpoint {checkpoint.path} was saved from another model: "
                         + "; ".join(differences) + ". Restore the model: settings it was "
                         "trained with (its commit.json has them) or use another checkpoint.dir")


def batch_change_warning(cfg: Config, checkpoint: Committed | None) -> str | None:
    """A changed global batch is allowed, but the run then no longer continues the saved one."""
    saved = checkpoint.record.get("global_batch_size") if checkpoint is not None else None
    if saved is None or saved == cfg.train.global_batch_size:
        return None
    return (f"warning: the checkpoint was trained with train.global_batch_size={saved}, the "
            f"config now says {cfg.train.global_batch_size}: the data position and the "
            "learning-rate step carry over, but this is no longer an exact continuation")


# ------------------------------------------------------------- command line --
def nproc_per_node(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer or 'auto' (got {value!r})") from None


def node_count(value: str) -> int:
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}; elastic ranges such as 1:4 are not supported because the batch split "
            "needs a fixed world size") from None


def auto_nproc() -> int:
    """CUDA GPUs of this node, else 1 (torchrun's auto: every CPU core, rarely a divisor)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.resume",
        description="Resume training from the newest complete checkpoint on any number of "
                    "GPUs: the global batch, learning-rate step and data order carry over, "
                    "gradient accumulation is recomputed.",
        epilog="Exit status: 0 finished; preemption.exit_code (75) preempted, run again; "
               "2 refused (bad config or world size); 73 last state not saved; 74 a node "
               "lost, run again; 79 no progress, do not retry; 130 interrupted; else "
               "torchrun's status.",
    )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=nproc_per_node,
                        default="auto", metavar="M|auto",
                        help="processes on this node (default auto: CUDA GPUs, else 1)")
    parser.add_argument("--nnodes", type=node_count, default=1, metavar="N",
                        help="number of nodes (default 1); more need --rdzv-endpoint")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                        metavar="HOST:PORT", help="rendezvous address shared by all nodes")
    parser.add_argument("--rdzv-id", "--rdzv_id", default=None, metavar="ID",
                        help="rendezvous id, the same on all nodes of one job")
    parser.add_argument("--rdzv-conf", "--rdzv_conf", type=rdzv_conf, default={},
                        metavar="KEY=VALUE,...", help="torchrun's other rendezvous settings, "
                        "e.g. is_host=1 on the node that hosts the rendezvous store; the "
                        "wait for the nodes is recovery.rendezvous_timeout_s")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print where training would resume as one JSON line on stdout and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, passed on to training")
    return parser.parse_args(argv)


@refusals
def main(argv: list[str] | None = None, zygote: Started | None = None) -> int:
    """The command; ``zygote``: the one ``resume.py`` started ahead of its imports."""
    args = parse_args(argv)
    # Warnings go to stderr: stdout stays clean for --dry-run's JSON.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if (too_old := torch_too_old()) is not None:   # before torchrun, whose options it may not know
        say(too_old)
        return exit_codes.BAD_INPUT
    where = "checkpoint.dir"
    try:
        cfg = load_config(args.config, args.overrides)
        where = f"checkpoint.dir={cfg.checkpoint.dir}"
        if zygote is not None and not cfg.recovery.warm_start:
            zygote.stop()
            zygote = None
        check_config(load_task(), cfg)  # the task's own sections, before torchrun starts
        storage = open_storage(cfg.checkpoint.dir)
        nproc = auto_nproc() if args.nproc_per_node == "auto" else args.nproc_per_node
        train_args = (["--config", args.config] if args.config else []) + list(args.overrides)
        command = torchrun_command("train", train_args, cfg.preemption, nproc_per_node=nproc,
                                   max_restarts=cfg.recovery.max_restarts,
                                   nnodes=str(args.nnodes), rdzv_endpoint=args.rdzv_endpoint,
                                   rdzv_id=args.rdzv_id, rdzv_conf=args.rdzv_conf,
                                   rendezvous_timeout_s=cfg.recovery.rendezvous_timeout_s,
                                   warm_start=cfg.recovery.warm_start)
        if not args.dry_run:  # a missing bucket or a full disk: refused before the launch
            ckpt = cfg.checkpoint
            check_storage(storage, ckpt.keep_last + ckpt.keep_best, ckpt.storage_retry_s)
        # Sizes and the commit record only: training checks the checksums as it loads.
        checkpoint = with_retries(
            lambda: newest_complete_checkpoint(storage, verify=VerifyMode.none.value),
            f"checkpoint.dir={storage}", cfg.checkpoint.storage_retry_s)
        if checkpoint is not None:
            _refuse_another_models_checkpoint(cfg, storage, checkpoint)
        if not args.dry_run:  # one writer per directory: refuse before starting torchrun
            lease = Lease(storage, stale_s=cfg.checkpoint.lease_stale_s,
                          wait_s=cfg.checkpoint.lease_wait_s)
            with_retries(lambda: lease.acquire(take=False), f"checkpoint.dir={storage}",
                         cfg.checkpoint.storage_retry_s)
        point = resume_point(cfg, checkpoint, nproc * args.nnodes)
    # ValueError: the launch builder's refusals; RuntimeError: an object store's missing driver
    except (ConfigError, BatchSizeError, LeaseHeld, ValueError, RuntimeError) as exc:
        raise Refused(exc) from None
    except Exception as exc:
        if (failure := command_failure(exc, where)) is None:
            raise
        status, sentence = failure
        raise Refused(sentence, status) from None

    _say_measured_mtbi(cfg, storage)
    human = sys.stderr if args.dry_run else sys.stdout
    print(point.describe(cfg.train.micro_batch_size, str(storage)), file=human)
    if warning := batch_change_warning(cfg, checkpoint):
        print(warning, file=sys.stderr)
    print(f"  command: {shlex.join(command)}", file=human, flush=True)
    if args.dry_run:
        print(f"  the newest start's phases ({cfg.log.dir}/metrics.jsonl):\n"
              + phases.breakdown(phases.newest_timeline(cfg.log.dir)), file=human)
        print(point.to_json(), flush=True)
        return 0
    if zygote is not None:   # the agent's workers are forked from it (launch/warm.py)
        os.environ[ZYGOTE_ENV] = zygote.path
    # The job id training's lease carries: the scheduler's, else torchrun's run id.
    job_id = scheduler_job_id() or args.rdzv_id or DEFAULT_RDZV_ID
    return supervise(command, storage, checkpoint, cfg.preemption, Path(cfg.log.dir),
                     nodes=args.nnodes, recovery=cfg.recovery, job_id=job_id,
                     memory_tier=cfg.checkpoint.memory_interval_steps > 0)


def _say_measured_mtbi(cfg: Config, storage: Storage) -> None:
    """The history's MTBI, unasked, when it excludes the configured one (ledger/advice.py)."""
    try:
        notice = mtbi_notice(cfg, storage, configured_inputs(cfg))
    except Exception:  # noqa: BLE001 - resuming does not depend on the history
        return
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- supervise --
def supervise(command: list[str], storage: Storage, before: Committed | None,
              preemption: PreemptionConfig, log_dir: Path, *, nodes: int = 1,
              recovery: RecoveryConfig | None = None, job_id: str | None = None,
              memory_tier: bool = False) -> int:
    """Run torchrun, forward signals to it, wait for every process of the launch, translate
    its status; after a node loss (74) remove the job's lease, so no start waits for it."""
    launched_at = time.time()
    forwarded: list[str] = []
    pending: list[int] = []
    launch: reaper.Launch | None = None

    def forward(signum: int, _frame) -> None:
        forwarded.append(signal.Signals(signum).name)
        if launch is None:
            pending.append(signum)      # arrived while torchrun was starting
        else:
            launch.signal(signum)       # to the agent, or to what it left behind

    names = dict.fromkeys([*ALWAYS_FORWARDED, *preemption.signals])
    previous = {sig: signal.signal(sig, forward) for sig in (signal.Signals[n] for n in names)}
    try:
        if held := early.take(list(previous)):   # signals that came while this command started
            return stopped_before_launch(held[0], preemption)
        # The agent stops the workers once this process is gone (launch/agent.py).
        stop = preemption.signals[0] if preemption.signals else "SIGINT"
        launch = reaper.Launch(watched(command, stop))
        for signum in pending:
            launch.signal(signum)
        returncode = launch.wait()
        if returncode < 0:
            say(reaper.describe_death(launch.proc.pid, returncode))
        bound = shutdown_timeout_s(preemption)
        for line in launch.wait_for_the_rest(bound, say):
            say(f"killed {line}: still running {bound} s after the agent exited")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if launch is not None:
            launch.close()
    lost = (node_lost_since(log_dir, launched_at, recovery) if nodes > 1 and returncode != 0
            and recovery is not None else None)
    status = exit_status(returncode, storage, before, preemption, forwarded,
                         stopped_by_notice=preemption_logged_since(log_dir, launched_at),
                         training_status=training_status_since(log_dir, launched_at),
                         node_lost=lost, memory_tier=memory_tier)
    if status == exit_codes.NODE_LOST and job_id is not None:
        try:   # a lease only read, then removed
            holder = Lease(storage, stale_s=0.0, wait_s=0.0).release_for_ended_job(job_id)
        except Exception as exc:  # noqa: BLE001 - the store down: it goes stale in time
            say(f"could not release this job's lease ({exit_codes.error_line(exc, 160)})")
        else:
            if holder is not None:
                say(f"released the lease of {holder}: this job has ended")
    return status
