"""Run configuration: a structured config (dataclasses) filled from YAML and key=value overrides.

OmegaConf checks types and rejects unknown keys (with a suggestion); the range checks
below catch values of the right type that still make no sense.

(A little over 400 lines: one dataclass per section of configs/train.yaml, each with its
range checks, read side by side as the file's own reference; the task's sections are
checked by the task.)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..runtime import exit_codes
from . import parts
from .plan_defaults import CRASH_SHARE, NODE_LOSS_SHARE, SHARE_SLACK
from .yaml_file import UnreadableConfig, read_yaml

DEFAULT_CONFIG = Path("configs/train.yaml")
# checkpoint.dir may be a path, a file:// URL or an object-store URL with one of these
# schemes (read through fsspec; copier.yml's checkpoint_dir question accepts the same).
OBJECT_STORE_SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


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


def require(condition: bool, key: str, message: str, value: object) -> None:
    if not condition:
        raise ConfigError(f"{key} {message} (got {value!r})")


def require_part(part: parts.Part, off: bool, setting: str, **answer: str) -> None:
    """A setting that turns on an optional part (``off`` false) needs the part rendered."""
    if not off and not parts.rendered(part):
        raise ConfigError(parts.missing(part, setting, **answer))


@dataclass
class TrainConfig:
    max_steps: int = 2000
    global_batch_size: int = 16
    micro_batch_size: int = 2
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 1234
    precision: Precision = Precision.fp32
    tf32: bool = False          # CUDA: fp32 matrix products and convolutions in TF32
    activation_checkpointing: bool = False
    compile: bool = False       # torch.compile each shard unit (checkpoint keys unchanged)

    def __post_init__(self) -> None:
        require(self.max_steps >= 1, "train.max_steps", "must be >= 1", self.max_steps)
        require(self.global_batch_size >= 1, "train.global_batch_size", "must be >= 1",
                 self.global_batch_size)
        require(self.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1",
                 self.micro_batch_size)
        require(self.global_batch_size % self.micro_batch_size == 0, "train.global_batch_size",
                 f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
                 self.global_batch_size)
        require(self.lr > 0, "train.lr", "must be > 0", self.lr)
        require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0", self.warmup_steps)
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]",
                 self.min_lr_ratio)
        require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0", self.weight_decay)
        require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)",
                 self.grad_clip)


@dataclass
class DistributedConfig:
    parallelism: Parallelism = Parallelism.fsdp
    backend: str = "auto"

    def __post_init__(self) -> None:
        require(self.backend in ("auto", "gloo", "nccl"), "distributed.backend",
                 "must be auto, gloo or nccl", self.backend)


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    interval_steps: int = 100
    keep_last: int = 3
    async_mode: AsyncMode = AsyncMode.process
    verify: VerifyMode = VerifyMode.all   # checksums checked as a checkpoint is loaded
    on_error: OnSaveError = OnSaveError.keep
    max_failed_saves: int = 3       # failed saves in a row before training stops (on_error: keep)
    # ... and at least this long without a commit: what such a stop throws away, so keep it
    # well above the plan's interval (interval_steps x step time, the work any interruption
    # risks); a storage broken for good stops training this long (+ one interval) after the
    # newest commit. 0: the count alone
    max_failed_saves_s: float = 300.0
    wait_timeout_s: float = 600.0   # longest wait for a save in flight before giving it up
    start_timeout_s: float = 120.0  # longest wait for the background checkpoint process to start
    strict_resume: bool = False     # a checkpoint that fails to load stops the run (no fallback)
    lease_stale_s: float = 120.0    # another job's lease without a heartbeat this long is taken over
    lease_wait_s: float = 60.0      # how long a start waits for a live lease to be released
    storage_retry_s: float = 120.0  # how long a command waits out unreachable storage (0: no retry)
    keep_best: int = 0              # the best checkpoints by best_metric, kept besides keep_last
    best_metric: str = "eval_loss"  # a field of the eval event (eval_<metric>)
    best_mode: str = "min"          # min | max
    memory_interval_steps: int = 0  # a copy in host memory (and on a partner node) every N steps; 0: off
    memory_dir: str = "/dev/shm"    # where the node's memory copies live (a tmpfs: RAM)

    def __post_init__(self) -> None:
        require(bool(self.dir.strip()), "checkpoint.dir", "must not be empty", self.dir)
        require(self.keep_best >= 0, "checkpoint.keep_best", "must be >= 0 (0 = off)",
                self.keep_best)
        require(self.best_mode in ("min", "max"), "checkpoint.best_mode", "must be min or max",
                self.best_mode)
        require(self.best_metric.startswith("eval_"), "checkpoint.best_metric",
                "must name an evaluation figure: eval_loss or eval_<metric>", self.best_metric)
        url = _URL.match(self.dir)
        if url:
            require(url.group(1) in ("file", *OBJECT_STORE_SCHEMES), "checkpoint.dir",
                     "must be a path, a file:// URL or an object-store URL with scheme "
                     f"{', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)} (lower case)",
                     self.dir)
        require(self.interval_steps >= 1, "checkpoint.interval_steps", "must be >= 1",
                 self.interval_steps)
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1", self.keep_last)
        require(self.memory_interval_steps >= 0, "checkpoint.memory_interval_steps",
                "must be >= 0 (0 = off)", self.memory_interval_steps)
        require_part(parts.MEMORY_TIER, not self.memory_interval_steps,
                     f"checkpoint.memory_interval_steps={self.memory_interval_steps}")
        require(bool(self.memory_dir.strip()) and not _URL.match(self.memory_dir),
                "checkpoint.memory_dir", "must be a local directory (a tmpfs such as /dev/shm)",
                self.memory_dir)
        require(self.max_failed_saves >= 1, "checkpoint.max_failed_saves", "must be >= 1",
                 self.max_failed_saves)
        for key in ("wait_timeout_s", "start_timeout_s", "lease_stale_s", "lease_wait_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, f"checkpoint.{key}",
                     "must be a finite number of seconds > 0", value)
        for key in ("storage_retry_s", "max_failed_saves_s"):
            require(math.isfinite(getattr(self, key)) and getattr(self, key) >= 0,
                    f"checkpoint.{key}", "must be a finite number of seconds >= 0",
                    getattr(self, key))


@dataclass
class PreemptionConfig:
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    grace_period_s: float = 30.0
    exit_code: int = exit_codes.PREEMPTED
    notice_source: NoticeSource = NoticeSource.none
    metadata_url: str = ""
    poll_interval_s: float = 5.0

    def __post_init__(self) -> None:
        for name in self.signals:
            require(isinstance(getattr(signal, str(name), None), signal.Signals),
                     "preemption.signals", "must name signals such as SIGTERM or SIGUSR1", name)
            require(name not in ("SIGKILL", "SIGSTOP"), "preemption.signals",
                     "cannot include a signal that cannot be caught", name)
        require(math.isfinite(self.grace_period_s) and 0 < self.grace_period_s <= 86400,
                 "preemption.grace_period_s", "must be a finite number of seconds in (0, 86400]",
                 self.grace_period_s)
        require(3 <= self.exit_code <= 127
                 and self.exit_code not in (exit_codes.NOT_SAVED, exit_codes.NODE_LOST,
                                            exit_codes.NO_PROGRESS, exit_codes.HUNG),
                 "preemption.exit_code",
                 f"must be in 3..127 and not {exit_codes.NOT_SAVED}, {exit_codes.NODE_LOST}, "
                 f"{exit_codes.NO_PROGRESS} or {exit_codes.HUNG} (0 finished, 1 crashed, 2 bad "
                 f"configuration, {exit_codes.NOT_SAVED} last state not saved, "
                 f"{exit_codes.NODE_LOST} a node lost, {exit_codes.NO_PROGRESS} no progress, "
                 f"{exit_codes.HUNG} a hung worker, 128+ killed by a signal)",
                 self.exit_code)
        require(self.poll_interval_s > 0, "preemption.poll_interval_s", "must be > 0",
                 self.poll_interval_s)
        source = NoticeSource(self.notice_source)
        require_part(parts.CLOUD_NOTICES, source == NoticeSource.none,
                     f"preemption.notice_source={source.value}", cloud=source.value)
        require(self.metadata_url == "" or self.metadata_url.startswith(("http://", "https://")),
                 "preemption.metadata_url",
                 "must be empty (the cloud's own address) or an http:// or https:// URL",
                 self.metadata_url)


@dataclass
class RecoveryConfig:
    """Failures other than preemptions: in-place restarts, hangs, stragglers (docs/RECOVERY.md)."""

    max_restarts: int = 3             # torchrun --max-restarts: in-place restarts of all workers
    step_timeout_s: float = 0.0       # watchdog; 0 = automatic: max(60 s, 10 x median step time)
    first_step_timeout_s: float = 600.0   # the first step of each start, and until steps are measured
    collective_timeout_s: float = 900.0   # the process group's bound on one collective
    max_attempts_without_progress: int = 3   # starts in a row without a new checkpoint; 0 = no limit
    straggler_every_steps: int = 0    # how often ranks compare their step times; 0 = never
    straggler_ratio: float = 1.5      # slower than the median of ranks by this factor: a straggler
    rendezvous_timeout_s: float = 120.0   # several nodes: how long they wait for each other
    warm_start: bool = True           # resume's workers forked from a pre-imported process

    def __post_init__(self) -> None:
        for key in ("max_restarts", "max_attempts_without_progress", "straggler_every_steps"):
            require(getattr(self, key) >= 0, f"recovery.{key}", "must be >= 0",
                     getattr(self, key))
        require(math.isfinite(self.step_timeout_s) and self.step_timeout_s >= 0,
                 "recovery.step_timeout_s", "must be a finite number of seconds >= 0 "
                 "(0 = automatic)", self.step_timeout_s)
        for key in ("first_step_timeout_s", "collective_timeout_s", "rendezvous_timeout_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, f"recovery.{key}",
                     "must be a finite number of seconds > 0", value)
        require(math.isfinite(self.straggler_ratio) and self.straggler_ratio > 1,
                 "recovery.straggler_ratio", "must be a finite number > 1", self.straggler_ratio)
        require_part(parts.STRAGGLERS, not self.straggler_every_steps,
                     f"recovery.straggler_every_steps={self.straggler_every_steps}")
        # A hung step must meet the watchdog (stacks, a `hang` event, exit 124) before the
        # process group's own timeout aborts the collective it hangs in (NCCL: exit -6,
        # no event): every watchdog bound stays below the collective bound.
        for key in ("first_step_timeout_s", "step_timeout_s"):
            value = getattr(self, key)
            require(value < self.collective_timeout_s, f"recovery.{key}",
                     f"must be shorter than recovery.collective_timeout_s="
                     f"{self.collective_timeout_s:g}, so that the watchdog finds a hung step "
                     "before the collective times out", value)


@dataclass
class LogConfig:
    dir: str = "logs"
    every_steps: int = 10
    trackers: list[str] = field(default_factory=list)   # tensorboard, wandb, mlflow

    def __post_init__(self) -> None:
        require(self.every_steps >= 1, "log.every_steps", "must be >= 1", self.every_steps)
        for name in self.trackers:
            require(name in TRACKERS, "log.trackers", f"names one of {', '.join(TRACKERS)}",
                    name)
        require_part(parts.TRACKERS, not self.trackers, f"log.trackers={list(self.trackers)}")


@dataclass
class EvalConfig:
    """Evaluation on the task's held-out data (``build_eval_data`` in task.py)."""

    every_steps: int = 0        # evaluate every N steps; 0 = never during training
    max_batches: int = 0        # eval micro-batches in all (over every rank); 0 = the whole set
    at_end: bool = True         # evaluate after the last step
    micro_batch_size: int = 0   # 0 = train.micro_batch_size

    def __post_init__(self) -> None:
        for key in ("every_steps", "max_batches", "micro_batch_size"):
            require(getattr(self, key) >= 0, f"eval.{key}", "must be >= 0", getattr(self, key))


START_METHODS = ("auto", "fork", "forkserver", "spawn")
TRACKERS = ("tensorboard", "wandb", "mlflow")   # log.trackers: what this project writes


@dataclass
class LoaderConfig:
    """The DataLoader the harness builds around the task's dataset."""

    num_workers: int = 0       # worker processes; 0 reads in the training process
    prefetch_factor: int = 2   # micro-batches each worker keeps ready (with num_workers > 0)
    # How workers start: auto = forkserver on CUDA (a fork would copy a process holding a
    # CUDA context and helper threads), fork otherwise; or fork | forkserver | spawn.
    start_method: str = "auto"

    def __post_init__(self) -> None:
        require(self.start_method in START_METHODS, "loader.start_method",
                f"must be one of {', '.join(START_METHODS)}", self.start_method)
        require(self.num_workers >= 0, "loader.num_workers", "must be >= 0", self.num_workers)
        require(self.prefetch_factor >= 1, "loader.prefetch_factor", "must be >= 1",
                self.prefetch_factor)


# Harness settings that used to live in the task's ``data:`` section, and where they are now.
MOVED_KEYS = {"data.num_workers": "loader.num_workers",
              "data.prefetch_factor": "loader.prefetch_factor"}


@dataclass
class PlanConfig:
    """Inputs of the checkpoint interval plan (`python -m <package>.plan`): your answers."""

    mtbi_hours: float = 8.0
    step_time_s: float = 2.0
    checkpoint_save_s: float = 10.0
    restart_s: float = 120.0
    badput_target_percent: float = 5.0
    crash_share: float = CRASH_SHARE   # assumed share of interruptions that are crashes
    nodes: int = 1   # mtbi_hours is one node's: the plan uses mtbi_hours / nodes for the job
    node_loss_share: float = NODE_LOSS_SHARE   # assumed share that takes one node's memory away

    def __post_init__(self) -> None:
        require(self.nodes >= 1, "plan.nodes", "must be a whole number >= 1 (nodes)", self.nodes)
        require(math.isfinite(self.crash_share) and 0 <= self.crash_share <= 1,
                 "plan.crash_share", "must be a number between 0 and 1", self.crash_share)
        require(math.isfinite(self.node_loss_share) and 0 <= self.node_loss_share <= 1,
                 "plan.node_loss_share", "must be a number between 0 and 1",
                 self.node_loss_share)
        require(self.crash_share + self.node_loss_share <= 1 + SHARE_SLACK, "plan.node_loss_share",
                 f"must be at most 1 - plan.crash_share = {1 - self.crash_share:g} (crashes, "
                 "node losses and job losses share the interruptions)", self.node_loss_share)
        # NaN and ±inf are refused too (NaN fails every comparison; inf is not finite).
        require(math.isfinite(self.mtbi_hours) and self.mtbi_hours > 0, "plan.mtbi_hours",
                 "must be a finite number > 0 (hours)", self.mtbi_hours)
        require(math.isfinite(self.step_time_s) and self.step_time_s > 0, "plan.step_time_s",
                 "must be a finite number > 0 (seconds)", self.step_time_s)
        require(math.isfinite(self.checkpoint_save_s) and self.checkpoint_save_s >= 0,
                 "plan.checkpoint_save_s", "must be a finite number >= 0 (seconds)",
                 self.checkpoint_save_s)
        require(math.isfinite(self.restart_s) and self.restart_s >= 0, "plan.restart_s",
                 "must be a finite number >= 0 (seconds)", self.restart_s)
        require(0 < self.badput_target_percent < 100, "plan.badput_target_percent",
                 "must be a number between 0 and 100, exclusive (percent)",
                 self.badput_target_percent)


TASK_SECTIONS = ("model", "data")  # the task's own sections (task.py reads them)


@dataclass
class Config:
    train: TrainConfig = field(default_factory=TrainConfig)
    # The task's sections (src/<package>/task.py reads them): free-form here, checked by
    # the task itself, e.g. with task_section() below.
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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (``configs/train.yaml`` by default) and apply ``key=value`` overrides.

    Raises ConfigError with a message that names the offending key.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found (pass --config PATH)")
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        _check_override_key(key)
        if not value and key.split(".")[0] not in TASK_SECTIONS:
            raise ConfigError(f"{key}: no value given (write {key}=VALUE)")
    try:
        values = read_yaml(path)  # conflict markers and YAML errors: file, line, what to do
    except UnreadableConfig as exc:
        raise ConfigError(str(exc)) from None
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(Config),
            values,
            OmegaConf.from_dotlist(list(overrides)),
        )
        _move_old_keys(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        # The first line says what is wrong (for a typo, with a suggestion); full_key says where.
        message = str(exc).split("\n")[0].strip()
        key = getattr(exc, "full_key", None)
        raise ConfigError(f"{key}: {message}" if key and key not in message else message) from None


def _move_old_keys(merged: Any) -> None:
    """Keys that moved (MOVED_KEYS) still work: their value goes to the new key, with a
    one-line notice on stderr naming it."""
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        values = merged[section]
        if key in values:
            value = values.pop(key)
            OmegaConf.update(merged, new, value)
            print(f"notice: {old} is now {new} (set {new}={value} instead; the old key keeps "
                  "working for now)", file=sys.stderr)


def _check_override_key(key: str) -> None:
    """Name the section of a key given without one (``max_steps`` -> ``train.max_steps``)."""
    if "." in key:
        return
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    if key in sections:
        return
    owners = [name for name, section in ((f.name, f.default_factory) for f in
                                         dataclasses.fields(Config))
              if name not in TASK_SECTIONS and key in {g.name for g in
                                                        dataclasses.fields(section())}]
    hint = (f"did you mean {' or '.join(f'{o}.{key}' for o in owners)}?" if owners
            else f"keys are section.name, sections: {', '.join(sections)}")
    raise ConfigError(f"{key}: not a key of the configuration; {hint}")


def to_plain_dict(config: Config) -> dict:
    """The resolved configuration as plain data (enums as strings), for commit.json."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True,
                                  enum_to_str=True)


Section = TypeVar("Section")


def task_section(values: dict[str, Any], schema: type[Section], prefix: str,
                 ignore: tuple[str, ...] = ()) -> Section:
    """Check a task-owned section (``model:``, ``data:``) against a dataclass of the task's.

    Unknown keys, wrong types and the dataclass's own ``__post_init__`` checks all raise
    ConfigError naming ``prefix.key``, so a task gets the harness's error messages (exit
    status 2, no traceback) for its own keys. Keys in ``ignore`` belong to the harness.
    """
    kept = {k: v for k, v in values.items() if k not in ignore}
    known = {f.name for f in dataclasses.fields(schema)}
    for key in kept:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}: not a key of {prefix} (known: "
                              f"{', '.join(sorted(known))})")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), kept)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        message = str(exc).split("\n")[0].strip()
        key = getattr(exc, "full_key", None)
        where = f"{prefix}.{key}" if key else prefix
        raise ConfigError(f"{where}: {message}") from None


def task_section_of_kind(values: dict[str, Any], kinds: dict[str, type], prefix: str,
                         default: str, ignore: tuple[str, ...] = ()) -> tuple[str, Any]:
    """``task_section`` for a section whose ``kind`` key chooses one of several dataclasses.

    Returns the kind and its checked section. The other kinds' keys may stay in the
    section (configs/train.yaml lists them all) and are left unchecked; a key of no kind
    is refused like any unknown key.
    """
    kind = values.get("kind", default)
    if kind not in kinds:
        raise ConfigError(f"{prefix}.kind must be one of {', '.join(kinds)} (got {kind!r})")
    own = {f.name for f in dataclasses.fields(kinds[kind])}
    others = {f.name for schema in kinds.values() for f in dataclasses.fields(schema)} - own
    return kind, task_section(values, kinds[kind], prefix, ignore=("kind", *others, *ignore))
