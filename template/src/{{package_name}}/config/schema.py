"""The run's configuration: one dataclass per section of configs/train.yaml, each field
with its range beside it (checks.py); ``__post_init__`` adds the rules that span fields or
need an optional part. Types, unknown keys: loading.py; the task's sections: the task."""

from __future__ import annotations

import enum
import re
import signal
from dataclasses import dataclass, field
from typing import Any

from ..runtime import exit_codes
from . import parts
from .checks import ConfigError, Rule, above, at_least, bounded, check_bounds, each, one_of, require
from .plan_defaults import CRASH_SHARE, NODE_LOSS_SHARE, SHARE_SLACK

# checkpoint.dir may be a path, a file:// URL or an object-store URL with one of these
# schemes (read through fsspec; copier.yml's checkpoint_dir question accepts the same).
OBJECT_STORE_SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
START_METHODS = ("auto", "fork", "forkserver", "spawn")
TRACKERS = ("tensorboard", "wandb", "mlflow")   # log.trackers: what this project writes
TASK_SECTIONS = ("model", "data")  # the task's own sections (task.py reads them)
SECONDS = "a finite number of seconds"
# preemption.exit_code: not a status the harness gives another meaning.
_TAKEN = (exit_codes.NOT_SAVED, exit_codes.NODE_LOST, exit_codes.NO_PROGRESS, exit_codes.HUNG)


def require_part(part: parts.Part, off: bool, setting: str, **answer: str) -> None:
    """A setting that turns on an optional part (``off`` false) needs the part rendered."""
    if not off and not parts.rendered(part):
        raise ConfigError(parts.missing(part, setting, **answer))


class AsyncMode(str, enum.Enum):
    process = "process"
    thread = "thread"
    sync = "sync"


class VerifyMode(str, enum.Enum):
    all = "all"        # checksum every byte of the checkpoint before loading it
    sample = "sample"  # small files whole, a part of each large one (checkpoint/store/integrity.py)
    none = "none"      # file sizes only


class Parallelism(str, enum.Enum):
    fsdp = "fsdp"
    ddp = "ddp"


class Precision(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"   # CUDA only: bf16 parameters and compute, fp32 gradient reduction


class OnSaveError(str, enum.Enum):
    stop = "stop"          # the first failed save stops training (exit status 73)
    keep = "keep"          # keep training for up to checkpoint.max_failed_saves failures in a row


class NoticeSource(str, enum.Enum):
    none = "none"
    aws = "aws"
    gcp = "gcp"
    azure = "azure"


@dataclass
class TrainConfig:
    max_steps: int = bounded(2000, at_least(1))
    global_batch_size: int = bounded(16, at_least(1))
    micro_batch_size: int = bounded(2, at_least(1))
    lr: float = bounded(3e-3, above(0))
    warmup_steps: int = bounded(20, at_least(0))
    min_lr_ratio: float = bounded(0.1, Rule(lambda v: 0 <= v <= 1, "must be in [0, 1]"))
    weight_decay: float = bounded(0.01, at_least(0))
    grad_clip: float = bounded(1.0, at_least(0, " (0 disables clipping)"))
    seed: int = 1234
    precision: Precision = Precision.fp32
    tf32: bool = False          # CUDA: fp32 matrix products and convolutions in TF32
    activation_checkpointing: bool = False
    compile: bool = False       # torch.compile each shard unit (checkpoint keys unchanged)

    def __post_init__(self) -> None:
        check_bounds(self, "train")
        require(self.global_batch_size % self.micro_batch_size == 0, "train.global_batch_size",
                 f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
                 self.global_batch_size)


@dataclass
class DistributedConfig:
    parallelism: Parallelism = Parallelism.fsdp
    backend: str = bounded("auto", one_of(("auto", "gloo", "nccl"), "must be auto, gloo or nccl"))

    def __post_init__(self) -> None:
        check_bounds(self, "distributed")


def _store_url(value: str) -> bool:
    url = _URL.match(value)
    return not url or url.group(1) in ("file", *OBJECT_STORE_SCHEMES)


@dataclass
class CheckpointConfig:
    dir: str = bounded("checkpoints", Rule(lambda v: bool(v.strip()), "must not be empty"),
                       Rule(_store_url, "must be a path, a file:// URL or an object-store URL "
                             f"with scheme {', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)} "
                             "(lower case)"))
    interval_steps: int = bounded(100, at_least(1))
    keep_last: int = bounded(3, at_least(1))
    async_mode: AsyncMode = AsyncMode.process
    verify: VerifyMode = VerifyMode.all   # checksums checked as a checkpoint is loaded
    on_error: OnSaveError = OnSaveError.keep
    max_failed_saves: int = bounded(3, at_least(1))   # in a row, then training stops (keep)
    # ... and at least this long without a commit (docs/RECOVERY.md); 0: the count alone
    max_failed_saves_s: float = bounded(300.0, at_least(0, noun=SECONDS))
    wait_timeout_s: float = bounded(600.0, above(0, noun=SECONDS))   # for a save in flight
    start_timeout_s: float = bounded(120.0, above(0, noun=SECONDS))  # for the checkpoint process
    strict_resume: bool = False     # a checkpoint that fails to load stops the run (no fallback)
    # another job's lease without a heartbeat this long is taken over
    lease_stale_s: float = bounded(120.0, above(0, noun=SECONDS))
    lease_wait_s: float = bounded(60.0, above(0, noun=SECONDS))   # for a live lease's release
    # how long a command waits out unreachable storage (0: no retry)
    storage_retry_s: float = bounded(120.0, at_least(0, noun=SECONDS))
    keep_best: int = bounded(0, at_least(0, " (0 = off)"))   # by best_metric, besides keep_last
    best_metric: str = bounded("eval_loss", Rule(lambda v: v.startswith("eval_"),
                               "must name an evaluation figure: eval_loss or eval_<metric>"))
    best_mode: str = bounded("min", one_of(("min", "max"), "must be min or max"))
    # a copy in host memory (and on a partner node) every N steps; 0: off
    memory_interval_steps: int = bounded(0, at_least(0, " (0 = off)"))
    memory_dir: str = bounded("/dev/shm", Rule(lambda v: bool(v.strip()) and not _URL.match(v),
                              "must be a local directory (a tmpfs such as /dev/shm)"))

    def __post_init__(self) -> None:
        check_bounds(self, "checkpoint")
        require_part(parts.MEMORY_TIER, not self.memory_interval_steps,
                     f"checkpoint.memory_interval_steps={self.memory_interval_steps}")


@dataclass
class PreemptionConfig:
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"], metadata=each(
        Rule(lambda v: isinstance(getattr(signal, str(v), None), signal.Signals),
              "must name signals such as SIGTERM or SIGUSR1"),
        Rule(lambda v: v not in ("SIGKILL", "SIGSTOP"),
              "cannot include a signal that cannot be caught")))
    grace_period_s: float = bounded(30.0, Rule(lambda v: 0 < v <= 86400,
                                    f"must be {SECONDS} in (0, 86400]"))
    exit_code: int = bounded(exit_codes.PREEMPTED, Rule(
        lambda v: 3 <= v <= 127 and v not in _TAKEN,
        f"must be in 3..127 and not {exit_codes.NOT_SAVED}, {exit_codes.NODE_LOST}, "
        f"{exit_codes.NO_PROGRESS} or {exit_codes.HUNG} (0 finished, 1 crashed, 2 bad "
        f"configuration, {exit_codes.NOT_SAVED} last state not saved, "
        f"{exit_codes.NODE_LOST} a node lost, {exit_codes.NO_PROGRESS} no progress, "
        f"{exit_codes.HUNG} a hung worker, 128+ killed by a signal)"))
    notice_source: NoticeSource = NoticeSource.none
    metadata_url: str = bounded("", Rule(
        lambda v: v == "" or v.startswith(("http://", "https://")),
        "must be empty (the cloud's own address) or an http:// or https:// URL"))
    poll_interval_s: float = bounded(5.0, above(0))

    def __post_init__(self) -> None:
        check_bounds(self, "preemption")
        source = NoticeSource(self.notice_source)
        require_part(parts.CLOUD_NOTICES, source == NoticeSource.none,
                     f"preemption.notice_source={source.value}", cloud=source.value)


@dataclass
class RecoveryConfig:
    """Failures other than preemptions: in-place restarts, hangs, stragglers (docs/RECOVERY.md)."""

    max_restarts: int = bounded(3, at_least(0))   # torchrun --max-restarts: all workers, in place
    # watchdog; 0 = automatic: max(60 s, 10 x median step time)
    step_timeout_s: float = bounded(0.0, at_least(0, " (0 = automatic)", SECONDS))
    # the first step of each start, and until steps are measured
    first_step_timeout_s: float = bounded(600.0, above(0, noun=SECONDS))
    collective_timeout_s: float = bounded(900.0, above(0, noun=SECONDS))  # one collective's bound
    # starts in a row without a new checkpoint; 0 = no limit
    max_attempts_without_progress: int = bounded(3, at_least(0))
    straggler_every_steps: int = bounded(0, at_least(0))   # ranks compare step times; 0 = never
    # slower than the median of ranks by this factor: a straggler
    straggler_ratio: float = bounded(1.5, above(1, noun="a finite number"))
    rendezvous_timeout_s: float = bounded(120.0, above(0, noun=SECONDS))  # several nodes' wait
    warm_start: bool = True           # resume's workers forked from a pre-imported process

    def __post_init__(self) -> None:
        check_bounds(self, "recovery")
        require_part(parts.STRAGGLERS, not self.straggler_every_steps,
                     f"recovery.straggler_every_steps={self.straggler_every_steps}")
        # A hung step must meet the watchdog (stacks, a `hang` event, exit 124) before the
        # collective's own timeout aborts it (NCCL: exit -6, no event).
        for key in ("first_step_timeout_s", "step_timeout_s"):
            value = getattr(self, key)
            require(value < self.collective_timeout_s, f"recovery.{key}",
                     f"must be shorter than recovery.collective_timeout_s="
                     f"{self.collective_timeout_s:g}, so that the watchdog finds a hung step "
                     "before the collective times out", value)


@dataclass
class LogConfig:
    dir: str = "logs"
    every_steps: int = bounded(10, at_least(1))
    trackers: list[str] = field(default_factory=list, metadata=each(
        one_of(TRACKERS, f"names one of {', '.join(TRACKERS)}")))

    def __post_init__(self) -> None:
        check_bounds(self, "log")
        require_part(parts.TRACKERS, not self.trackers, f"log.trackers={list(self.trackers)}")


@dataclass
class EvalConfig:
    """Evaluation on the task's held-out data (``build_eval_data`` in task.py)."""

    every_steps: int = bounded(0, at_least(0))  # evaluate every N steps; 0 = never during training
    max_batches: int = bounded(0, at_least(0))   # micro-batches over every rank; 0 = all of it
    at_end: bool = True         # evaluate after the last step
    micro_batch_size: int = bounded(0, at_least(0))   # 0 = train.micro_batch_size

    def __post_init__(self) -> None:
        check_bounds(self, "eval")


@dataclass
class LoaderConfig:
    """The DataLoader the harness builds around the task's dataset."""

    num_workers: int = bounded(0, at_least(0))  # worker processes; 0 reads in the training process
    prefetch_factor: int = bounded(2, at_least(1))   # micro-batches each worker keeps ready
    # auto = forkserver on CUDA, fork otherwise | fork | forkserver | spawn (docs/EXTENDING.md)
    start_method: str = bounded("auto", one_of(START_METHODS))

    def __post_init__(self) -> None:
        check_bounds(self, "loader")


SHARE = Rule(lambda v: 0 <= v <= 1, "must be a number between 0 and 1")


@dataclass
class PlanConfig:
    """Inputs of the checkpoint interval plan (`python -m <package>.plan`): your answers."""

    mtbi_hours: float = bounded(8.0, above(0, " (hours)", "a finite number"))
    step_time_s: float = bounded(2.0, above(0, " (seconds)", "a finite number"))
    checkpoint_save_s: float = bounded(10.0, at_least(0, " (seconds)", "a finite number"))
    restart_s: float = bounded(120.0, at_least(0, " (seconds)", "a finite number"))
    badput_target_percent: float = bounded(5.0, Rule(
        lambda v: 0 < v < 100, "must be a number between 0 and 100, exclusive (percent)"))
    crash_share: float = bounded(CRASH_SHARE, SHARE)   # assumed share of interruptions
    # mtbi_hours is one node's: the plan uses mtbi_hours / nodes for the job
    nodes: int = bounded(1, at_least(1, " (nodes)", "a whole number"))
    node_loss_share: float = bounded(NODE_LOSS_SHARE, SHARE)   # one node's memory lost

    def __post_init__(self) -> None:
        check_bounds(self, "plan")
        require(self.crash_share + self.node_loss_share <= 1 + SHARE_SLACK, "plan.node_loss_share",
                 f"must be at most 1 - plan.crash_share = {1 - self.crash_share:g} (crashes, "
                 "node losses and job losses share the interruptions)", self.node_loss_share)


@dataclass
class Config:
    train: TrainConfig = field(default_factory=TrainConfig)
    # The task's sections (src/<package>/task.py reads them): free-form here, checked by
    # the task itself, e.g. with task_section() (loading.py).
    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    log: LogConfig = field(default_factory=LogConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
