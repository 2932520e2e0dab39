"""Experiment trackers (``log.trackers``), written by rank 0: one tracker run across
every start of the job.

The run's identity is kept in ``checkpoint.dir`` (``tracking.json``), so every start that
resumes the checkpoints continues the same tracker run, and the points a dead attempt
logged after its newest checkpoint are superseded, not duplicated: TensorBoard through
``purge_step=s + 1`` for a start that resumes step s, W&B by rewinding the run to step s
(``resume_from``), MLflow by sending a step's points only once a checkpoint covering it
is committed. W&B's client writes or sends every half second here; points it had not yet
written or sent when the job was killed are lost (on a loaded machine a killed attempt
lost all of them). A tracker that fails is dropped with one line on stderr;
``metrics.jsonl`` keeps every event. Tags, and where each tracker writes: README.md,
"Track your runs".
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from .. import PACKAGE
from ..checkpoint.store.storage import Storage
from ..config import ConfigError
from ..runtime.metrics import Event

RUN_FILE = "tracking.json"   # in checkpoint.dir: the tracker run these checkpoints belong to
SKIPPED = {"step", "time", "event"}
CLOSE_TIMEOUT_S = 60.0       # a tracker's last flush (W&B's finish) may take this long
MLFLOW_BATCH = 1000          # MLflow's limit of metrics per log_batch call
# W&B writes its run file every 15 s by default: a killed job would lose that much.
WANDB_FLUSH, WANDB_FLUSH_S = "x_transaction_log_flush_interval", 0.5


class Tracker(Protocol):
    def log(self, kind: Event, fields: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def run_identity(storage: Storage) -> dict[str, Any]:
    """The tracker run of this checkpoint directory, made at its first start: its id,
    and what each tracker keeps to continue it (``wandb``: started; ``mlflow_run_id``)."""
    try:
        return json.loads(storage.read_text(RUN_FILE))
    except (FileNotFoundError, ValueError):
        run = {"run_id": uuid.uuid4().hex[:16]}
        remember(storage, run)
        return run


def remember(storage: Storage, run: dict[str, Any]) -> None:
    storage.makedirs()
    storage.write_text_durable(RUN_FILE, json.dumps(run) + "\n")


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


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys (``train`` / ``lr`` becomes ``train.lr``): the
    trackers' run parameters."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def missing(name: str, package: str) -> ConfigError:
    return ConfigError(f"log.trackers=[{name}] needs the {package} package, the project's "
                       f"`{name}` extra: python -m pip install -e '.[{name}]'")


class TensorBoardTracker:
    """TensorBoard event files under ``<log.dir>/tensorboard/<run id>``."""

    def __init__(self, log_dir: str, run_id: str, resumed_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing("tensorboard", "tensorboard") from None
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


class WandbTracker:
    """A W&B run whose id is the run id (``WANDB_MODE=offline``: files under
    ``<log.dir>/wandb``, uploaded later with ``wandb sync``). The project is
    ``WANDB_PROJECT`` or the package's name."""

    def __init__(self, log_dir: str, run: dict[str, Any], storage: Storage,
                 config: dict[str, Any], resumed_step: int | None) -> None:
        try:
            import wandb
        except ImportError:
            raise missing("wandb", "wandb") from None
        settings: dict[str, Any] = {"console": "off"}
        if WANDB_FLUSH in getattr(wandb.Settings, "model_fields", {}):
            settings[WANDB_FLUSH] = WANDB_FLUSH_S
        kwargs: dict[str, Any] = {
            "project": os.environ.get("WANDB_PROJECT", PACKAGE), "dir": log_dir,
            "config": flat(config), "settings": wandb.Settings(**settings)}
        run_id = run["run_id"]
        if run.get("wandb"):   # an earlier start made it: rewind to the resumed step
            kwargs["resume_from"] = f"{run_id}?_step={resumed_step or 0}"
        else:
            kwargs.update(id=run_id, resume="allow")
        self.run = wandb.init(**kwargs)
        if not run.get("wandb"):
            run["wandb"] = True
            remember(storage, run)
        # Saves commit and stops happen after later steps were logged: their points have
        # x-axes of their own (W&B's own step only grows).
        for section in ("checkpoint", "stop"):
            self.run.define_metric(f"{section}/step")
            self.run.define_metric(f"{section}/*", step_metric=f"{section}/step")
        self.step = resumed_step or 0

    def log(self, kind: Event, fields: dict[str, Any]) -> None:
        step, values = scalars(kind, fields)
        if step is None or not values:
            return
        if kind in (Event.save, Event.preemption):
            values[f"{'checkpoint' if kind == Event.save else 'stop'}/step"] = step
        self.step = max(self.step, step)
        self.run.log(values, step=self.step)

    def close(self) -> None:
        bounded(self.run.finish, "wandb")


class MlflowTracker:
    """An MLflow run in ``MLFLOW_TRACKING_URI`` (default: the SQLite file
    ``<log.dir>/mlflow.db``), experiment ``MLFLOW_EXPERIMENT_NAME`` or the package's
    name. Its id joins the run id in ``tracking.json``.

    MLflow keeps every point sent to it, so a point waits until the checkpoint covering
    its step is committed: points a crash would make a resumed run log again are never
    sent twice.
    """

    def __init__(self, log_dir: str, run: dict[str, Any], storage: Storage,
                 config: dict[str, Any], resumed_step: int | None) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing("mlflow", "mlflow-skinny") from None
        self.metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (
            f"sqlite:///{os.path.abspath(os.path.join(log_dir, 'mlflow.db'))}")
        os.makedirs(log_dir, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = run.get("mlflow_run_id")
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PACKAGE)
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(name))
            self.run_id = self.client.create_run(experiment_id, run_name=run["run_id"]).info.run_id
            params = [(k, str(v)[:6000]) for k, v in flat(config).items()]
            for first in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=[
                    Param(k, v) for k, v in params[first:first + 100]])
            run["mlflow_run_id"] = self.run_id
            remember(storage, run)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self.committed = resumed_step or 0   # points up to here are in MLflow already
        self.pending: list[Any] = []

    def log(self, kind: Event, fields: dict[str, Any]) -> None:
        step, values = scalars(kind, fields)
        if kind == Event.save and fields.get("step") is not None:
            self.committed = max(self.committed, fields["step"])
        if step is not None and values:
            now = int(time.time() * 1000)
            self.pending += [self.metric(k, v, now, step) for k, v in values.items()]
        self.send()

    def send(self) -> None:
        ready = [m for m in self.pending if m.step <= self.committed]
        if not ready:
            return
        self.pending = [m for m in self.pending if m.step > self.committed]
        for first in range(0, len(ready), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=ready[first:first + MLFLOW_BATCH])

    def close(self) -> None:
        # Points after the newest commit stay unsent: the run that resumes logs them.
        self.send()
        bounded(lambda: self.client.set_terminated(self.run_id), "mlflow")


def bounded(call: Callable[[], Any], name: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Run a tracker's closing call, waiting at most ``timeout_s`` for it."""
    done = threading.Event()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - reported below, training is done
            failure.append(exc)
        done.set()

    threading.Thread(target=target, name=f"close-{name}", daemon=True).start()
    if not done.wait(timeout_s):
        print(f"log.trackers: {name} did not finish closing within {timeout_s:g} s; "
              "going on without waiting", file=sys.stderr, flush=True)
    elif failure:
        print(f"log.trackers: {name} failed to close: {failure[0]}", file=sys.stderr,
              flush=True)


class Guarded:
    """A tracker whose failures drop it (one line on stderr) instead of the run."""

    def __init__(self, name: str, tracker: Tracker) -> None:
        self.name, self.tracker = name, tracker

    def log(self, kind: Event, fields: dict[str, Any]) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.log(kind, fields)
        except Exception as exc:  # noqa: BLE001 - a tracker must not end training
            print(f"log.trackers: {self.name} failed ({type(exc).__name__}: {exc}); "
                  "training goes on without it (metrics.jsonl has every event)",
                  file=sys.stderr, flush=True)
            self.tracker = None

    def close(self) -> None:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - reported, training is done
                print(f"log.trackers: {self.name} failed to close: {exc}",
                      file=sys.stderr, flush=True)


def open_trackers(names: list[str], log_dir: str, storage: Storage,
                  resumed_step: int | None, config: dict[str, Any]) -> list[Tracker]:
    """The trackers ``log.trackers`` names, continuing this checkpoint directory's run
    (rank 0 only). ``resumed_step``: the step this start resumed from (None: fresh);
    ``config``: the resolved configuration, the run's parameters.

    A tracker whose package is missing is a ConfigError (exit 2); one that cannot start
    (a tracking server down) is left out with one line on stderr."""
    if not names:
        return []
    run = run_identity(storage)
    openers: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoardTracker(log_dir, run["run_id"], resumed_step),
        "wandb": lambda: WandbTracker(log_dir, run, storage, config, resumed_step),
        "mlflow": lambda: MlflowTracker(log_dir, run, storage, config, resumed_step),
    }
    trackers: list[Tracker] = []
    for name in names:
        try:
            trackers.append(Guarded(name, openers[name]()))
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tracker must not end training
            print(f"log.trackers: {name} could not start ({type(exc).__name__}: {exc}); "
                  "training goes on without it (metrics.jsonl has every event)",
                  file=sys.stderr, flush=True)
    return trackers
