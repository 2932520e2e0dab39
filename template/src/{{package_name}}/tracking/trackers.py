"""Experiment trackers (``log.trackers``), written by rank 0: one tracker run across
every start of the job.

The run's identity is kept in ``checkpoint.dir`` (``tracking.json``), so it moves with
the checkpoints: every start that resumes them continues the same tracker run. Points a
dead attempt logged after its newest checkpoint are superseded, not duplicated: a start
that resumes step s tells the tracker that everything from step s + 1 on is written
again (TensorBoard: ``SummaryWriter(purge_step=s + 1)``, which its readers apply).

What goes where (scalar tags):

- ``step`` events: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/<metric>``
  (the task's metrics and the step's timings);
- ``eval`` events: ``eval/loss``, ``eval/<metric>``;
- ``save`` events: ``checkpoint/save_s`` (the write), ``checkpoint/blocking_s``,
  ``checkpoint/commit_latency_s`` at the saved step;
- ``preemption`` events: ``stop/signal_to_commit_s``, ``stop/grace_left_s`` at the stop's
  step.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Protocol

from ..checkpoint.storage import Storage
from ..config import ConfigError
from ..runtime.metrics import Event

RUN_FILE = "tracking.json"   # in checkpoint.dir: the tracker run these checkpoints belong to
SKIPPED = {"step", "time", "event"}


class Tracker(Protocol):
    def log(self, kind: Event, fields: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def run_identity(storage: Storage) -> dict[str, Any]:
    """The tracker run of this checkpoint directory, made at its first start."""
    try:
        return json.loads(storage.read_text(RUN_FILE))
    except (FileNotFoundError, ValueError):
        run = {"run_id": uuid.uuid4().hex[:16]}
        storage.makedirs()
        storage.write_text_durable(RUN_FILE, json.dumps(run) + "\n")
        return run


def scalars(kind: Event, fields: dict[str, Any]) -> tuple[int | None, dict[str, float]]:
    """The step and the scalar tags of one event (an empty dict: nothing to track)."""
    numbers = {k: float(v) for k, v in fields.items()
               if k not in SKIPPED and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kind == Event.step:
        return fields.get("step"), {f"train/{k}": v for k, v in numbers.items()}
    if kind == Event.eval:
        return fields.get("step"), {f"eval/{k.removeprefix('eval_')}": v
                                    for k, v in numbers.items()}
    if kind == Event.save:
        names = {"write_s": "save_s", "blocking_s": "blocking_s",
                 "commit_latency_s": "commit_latency_s"}
        return fields.get("step"), {f"checkpoint/{names[k]}": v for k, v in numbers.items()
                                    if k in names}
    if kind == Event.preemption:
        names = ("signal_to_commit_s", "grace_left_s")
        return fields.get("stop_step"), {f"stop/{k}": v for k, v in numbers.items()
                                         if k in names}
    return None, {}


class TensorBoardTracker:
    """TensorBoard event files under ``<log.dir>/tensorboard/<run id>``."""

    def __init__(self, log_dir: str, run_id: str, resumed_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("log.trackers=[tensorboard] needs the tensorboard package, the "
                              "project's `tensorboard` extra: python -m pip install -e "
                              "'.[tensorboard]'") from None
        self.path = os.path.join(log_dir, "tensorboard", run_id)
        purge = resumed_step + 1 if resumed_step is not None else None
        self.writer = SummaryWriter(self.path, purge_step=purge)

    def log(self, kind: Event, fields: dict[str, Any]) -> None:
        step, values = scalars(kind, fields)
        if step is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        if kind != Event.step:
            self.writer.flush()   # rare events: on disk at once

    def close(self) -> None:
        self.writer.close()


def open_trackers(names: list[str], log_dir: str, storage: Storage,
                  resumed_step: int | None) -> list[Tracker]:
    """The trackers ``log.trackers`` names, continuing this checkpoint directory's run
    (rank 0 only). ``resumed_step``: the step this start resumed from (None: fresh)."""
    if not names:
        return []
    run = run_identity(storage)
    trackers: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(log_dir, run["run_id"], resumed_step))
    return trackers
