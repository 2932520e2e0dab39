"""Which checkpoint a start resumes from, and loading it: newest first, checked, with
fallback to older ones.

Rank 0 picks each candidate (it alone reads the listing and commit records); every rank
loads it, checking the checksums as it reads (``reader.py``): the bytes are read once. A
damaged checkpoint is skipped with a warning; one of another model is refused with what
differs (exit status 2); one that fails otherwise (damage the checksums missed, an unsafe
``.metadata``) is skipped for the one before it, unless ``checkpoint.strict_resume``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ...config import Config
from ...config.schedule import lr_factor
from ...runtime import phases
from ...runtime.distributed import Runtime, any_rank, decide_on_rank0
from ...runtime.exit_codes import error_line
from ...runtime.metrics import MetricsLog
from ...runtime.phases import Phase
from ..store.integrity import ChecksumMismatch, expected
from ..store.layout import Committed, sized_newest_first
from ..store.storage import Storage
from . import compat
from .reader import open_reader
from .safe_load import SafeLoadPlanner, UnsafeCheckpointError, failure_of

log = logging.getLogger(__name__)


class IncompatibleCheckpoint(ValueError):
    """The newest checkpoint was saved from another model; the message lists what differs."""


class CheckpointUnusable(RuntimeError):
    """No checkpoint in checkpoint.dir can be loaded (or, strictly, not the newest)."""


class TrainingState(Protocol):
    """What the checkpointer saves and loads of the training loop (loop.trainer.Trainer)."""

    progress: Any           # checkpoint/state.py's Progress: the step it reached
    uses_default_schedule: bool   # the learning rate follows config.schedule

    def state(self, *, with_rng: bool = True) -> dict[str, Any]: ...

    def commit_record(self) -> dict[str, Any]: ...

    def model_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def reseed(self, step: int) -> None: ...


def choose_and_load(storage: Storage, verify: str, training: TrainingState, cfg: Config,
                    runtime: Runtime, metrics: MetricsLog) -> Committed | None:
    """Load the newest checkpoint that loads into ``training`` and return it; None if none."""
    shapes = training.model_shapes()
    # Not read beforehand: the load checks their checksums as it reads (load_checkpoint).
    candidates = sized_newest_first(storage) if runtime.is_main else iter(())
    failures: list[str] = []
    while True:
        checkpoint, differences, unreadable = decide_on_rank0(
            lambda: _next_candidate(storage, verify, candidates, shapes, cfg))
        phases.mark(Phase.checkpoint_chosen)
        if checkpoint is None:
            if failures:
                raise CheckpointUnusable(
                    f"no checkpoint in {storage} could be loaded "
                    f"({'; '.join(failures)}); move them away or use another checkpoint.dir")
            return None
        if differences:
            raise IncompatibleCheckpoint(
                f"checkpoint {checkpoint.path} was saved from another model: "
                + "; ".join(differences) + ". Restore the model: settings it was trained "
                "with (its commit.json has them) or use another checkpoint.dir")
        error, damaged = (unreadable if unreadable is not None
                          else _load(storage, verify, checkpoint, training, runtime, metrics))
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


def _next_candidate(storage: Storage, verify: str, candidates, shapes: dict, cfg: Config
                    ) -> tuple[Committed | None, list[str], tuple[str, bool] | None]:
    """Rank 0: the next checkpoint to try, what differs from this model, and why it is
    unreadable (the sentence, whether it is damage) or None."""
    if (checkpoint := next(candidates, None)) is None:
        return None, [], None
    checksums = None if verify == "none" else expected(checkpoint.record)
    try:
        differences = compat.differences(
            compat.saved_model_shapes(storage, checkpoint.name, checksums), shapes,
            checkpoint.record.get("config", {}).get("model"), cfg.model)
    except (OSError, RuntimeError) as exc:  # incl. UnsafeCheckpointError, ChecksumMismatch
        return checkpoint, [], (str(exc), isinstance(exc, ChecksumMismatch))
    return checkpoint, differences, None


def _load(storage: Storage, verify: str, checkpoint: Committed, training: TrainingState,
          runtime: Runtime, metrics: MetricsLog) -> tuple[str | None, bool]:
    """Load one checkpoint: (why it failed or None, whether its checksums found damage)."""
    # RNG streams belong to ranks on one kind of device: they only carry over when
    # the ranks and the device kind do (a CPU save holds no CUDA generator state).
    saved_device = checkpoint.record.get("device_type", "cpu")
    same_streams = (checkpoint.world_size == runtime.world_size
                    and saved_device == runtime.device.type)
    try:
        load_checkpoint(storage, training.state(with_rng=same_streams), checkpoint, verify)
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


def load_checkpoint(storage: Storage, state: dict[str, Any], checkpoint: Committed,
                    verify: str = "all") -> None:
    """Load ``state`` in place from ``checkpoint``, resharded by DCP; nothing in it runs as
    code (UnsafeCheckpointError on every rank), a damaged block raises ChecksumMismatch."""
    checksums = None if verify == "none" else expected(checkpoint.record)
    reader = open_reader(storage, checkpoint.name, checksums)
    try:
        # Every rank reads .metadata for itself, so every rank refuses a bad one here,
        # before DCP's collectives begin: none is left waiting for another.
        with _garbage_collection_paused():
            reader.read_metadata()
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as exc:
        # Any rank's mismatch: the message names the file and bytes.
        if (damaged := failure_of(exc, ChecksumMismatch)) is not None:
            raise ChecksumMismatch(str(damaged)) from None
        if (unsafe := failure_of(exc, UnsafeCheckpointError)) is None:
            raise
        raise UnsafeCheckpointError(f"checkpoint {checkpoint.path}: {unsafe}") from None


@contextlib.contextmanager
def _garbage_collection_paused():
    """No full garbage collection mid-load: over a trainer's objects it cost 0.2-0.3 s of a
    0.3 s load (docs/PERFORMANCE.md); reference counting frees what the load leaves."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
