"""Which checkpoint a start resumes from, and loading it: newest first, checked, with
fallback to older ones.

Rank 0 picks each candidate (it alone reads the listing and the commit records) and
every rank loads the same one, checking the checksums of what it reads as it reads it
(``reader.py``): the bytes are read once. A damaged checkpoint (a block that does not
match its checksum) is skipped with a warning, as discovery always skipped it; one of
another model is refused with what differs (exit status 2); one that fails to load for
another reason (damage the checksums could not see, an unsafe ``.metadata``) is skipped
for the one before it, unless ``checkpoint.strict_resume``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from torch.distributed.checkpoint.api import CheckpointException

from ..config import Config
from ..config.schedule import lr_factor
from ..runtime import phases
from ..runtime.distributed import Runtime, any_rank, decide_on_rank0
from ..runtime.exit_codes import error_line
from ..runtime.metrics import MetricsLog
from ..runtime.phases import Phase
from . import compat
from .integrity import ChecksumMismatch, expected
from .layout import Committed
from .manager import CheckpointManager
from .state import Progress

log = logging.getLogger(__name__)


class IncompatibleCheckpoint(ValueError):
    """The newest checkpoint was saved from another model; the message lists what differs."""


class CheckpointUnusable(RuntimeError):
    """No checkpoint in checkpoint.dir can be loaded (or, strictly, not the newest)."""


class TrainingState(Protocol):
    """What the checkpointer saves and loads of the training loop (loop.trainer.Trainer)."""

    progress: Progress
    uses_default_schedule: bool   # the learning rate follows config.schedule

    def state(self, *, with_rng: bool = True) -> dict[str, Any]: ...

    def commit_record(self) -> dict[str, Any]: ...

    def model_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def reseed(self, step: int) -> None: ...


def choose_and_load(manager: CheckpointManager, training: TrainingState, cfg: Config,
                    runtime: Runtime, metrics: MetricsLog) -> Committed | None:
    """Load the newest checkpoint that loads into ``training``; None when there is none."""
    shapes = training.model_shapes()
    candidates = manager.candidates() if runtime.is_main else iter(())
    failures: list[str] = []
    while True:
        checkpoint, differences, unreadable = decide_on_rank0(
            lambda: _next_candidate(manager, candidates, shapes, cfg))
        phases.mark(Phase.checkpoint_chosen)
        if checkpoint is None:
            if failures:
                raise CheckpointUnusable(
                    f"no checkpoint in {manager.storage} could be loaded "
                    f"({'; '.join(failures)}); move them away or use another checkpoint.dir")
            return None
        if differences:
            raise IncompatibleCheckpoint(
                f"checkpoint {checkpoint.path} was saved from another model: "
                + "; ".join(differences) + ". Restore the model: settings it was trained "
                "with (its commit.json has them) or use another checkpoint.dir")
        error, damaged = (unreadable if unreadable is not None
                          else _load(manager, checkpoint, training, runtime, metrics))
        failed, damaged_somewhere = any_rank(error is not None, damaged)
        if not failed:
            phases.mark(Phase.loaded)
            if training.uses_default_schedule:
                warn_if_schedule_changed(checkpoint, cfg, training.progress.step, metrics.say)
            return checkpoint
        why = f"{checkpoint.path}: {error or 'failed on another rank'}"
        if damaged_somewhere:   # whatever strict_resume says, as discovery always did
            if damaged:
                log.warning("skipping checkpoint %s", why)
            continue
        if cfg.checkpoint.strict_resume:
            raise CheckpointUnusable(f"cannot load checkpoint {why} (checkpoint.strict_resume "
                                     "is on, so older checkpoints are not tried)")
        metrics.say(f"warning: cannot load checkpoint {why}; trying the one before it")
        failures.append(why)


def _next_candidate(manager: CheckpointManager, candidates, shapes: dict, cfg: Config
                    ) -> tuple[Committed | None, list[str], tuple[str, bool] | None]:
    """Rank 0: the next checkpoint to try, what differs from this model, and why it is
    unreadable (the sentence, whether it is damage) or None."""
    checkpoint = next(candidates, None)
    if checkpoint is None:
        return None, [], None
    checksums = None if manager.verify == "none" else expected(checkpoint.record)
    try:
        differences = compat.differences(
            compat.saved_model_shapes(manager.storage, checkpoint.name, checksums), shapes,
            checkpoint.record.get("config", {}).get("model"), cfg.model)
    except (OSError, RuntimeError) as exc:  # incl. UnsafeCheckpointError, ChecksumMismatch
        return checkpoint, [], (str(exc), isinstance(exc, ChecksumMismatch))
    return checkpoint, differences, None


def _load(manager: CheckpointManager, checkpoint: Committed, training: TrainingState,
          runtime: Runtime, metrics: MetricsLog) -> tuple[str | None, bool]:
    """Load one checkpoint into the training state; returns why it failed (or None) and
    whether that is damage its checksums found."""
    # RNG streams belong to ranks on one kind of device: they only carry over when
    # the ranks and the device kind do (a CPU save holds no CUDA generator state).
    saved_device = checkpoint.record.get("device_type", "cpu")
    same_streams = (checkpoint.world_size == runtime.world_size
                    and saved_device == runtime.device.type)
    try:
        manager.load(training.state(with_rng=same_streams), checkpoint)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the caller falls back
        if isinstance(exc, ChecksumMismatch):   # the file and bytes, as discovery says them
            return str(exc), True
        return error_line(exc, limit=None), False
    if not same_streams:
        training.reseed(training.progress.step)
        metrics.say(
            f"notice: checkpoint saved on {checkpoint.world_size} {saved_device} rank(s), "
            f"resuming on {runtime.world_size} {runtime.device.type} rank(s): "
            "random streams reseeded from (seed, step, rank)")
    return None, False


def warn_if_schedule_changed(checkpoint: Committed, cfg: Config, step: int,
                             say: Callable[[str], None]) -> None:
    """The default schedule is a function of train.max_steps: changing it on resume
    redraws the learning rate from the next step on. Say so, with both values."""
    saved = checkpoint.record.get("config", {}).get("train", {})
    train = cfg.train
    if saved.get("max_steps") in (None, train.max_steps):
        return
    before = train.lr * lr_factor(step, saved.get("warmup_steps", train.warmup_steps),
                                  saved["max_steps"],
                                  saved.get("min_lr_ratio", train.min_lr_ratio))
    after = train.lr * lr_factor(step, train.warmup_steps, train.max_steps, train.min_lr_ratio)
    now, then = distinct_figures(after, before)
    change = (f"the learning rate is {now} instead of {then}" if after != before else
              f"the learning rate is still {now}, and the steps after it follow the new "
              "schedule")
    say(f"warning: train.max_steps is {train.max_steps}, the checkpoint's run had "
        f"{saved['max_steps']}: the learning-rate schedule is redrawn, at step {step + 1} "
        f"{change}. To continue the saved run exactly, keep "
        f"train.max_steps={saved['max_steps']}")


def distinct_figures(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with 6 significant digits, or as many more as it takes for the two
    to read differently (17 tell any two floats apart)."""
    for digits in range(6, 18):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1] or a == b:
            return shown
    return shown
