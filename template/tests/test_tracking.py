"""Experiment trackers across a crash: one tracker run, each step's point exactly once.

Read back with each tracker's own reader: TensorBoard's EventAccumulator, MLflow's client
on its SQLite store, and W&B's offline run files (its record format, parsed with W&B's
own protocol buffers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import sys
import time

import pytest

from conftest import (
    descendants,
    project_module,
    read_events,
    run_module,
    start,
    torchrun,
    wait_until,
)

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")
wandb_records = pytest.importorskip("wandb.proto.wandb_internal_pb2")
mlflow_tracking = pytest.importorskip("mlflow.tracking")

STEPS = 20
# Steps of a few tenths of a second: the kill lands between step 12 and the save of 15,
# and W&B's client has written what came before the checkpoint (every 0.5 s).
RUN = ["model.d_model=192", "model.n_layers=3", "train.micro_batch_size=2",
       f"train.max_steps={STEPS}", "checkpoint.interval_steps=5", "eval.every_steps=5",
       "eval.max_batches=8", "log.trackers=[tensorboard,wandb,mlflow]", "log.every_steps=1"]
WANDB_BLOCK, WANDB_HEADER = 32768, 7   # W&B's run file: 32 KiB blocks of framed records


def scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point of ``tag`` in the one tracker run under ``log_dir``."""
    runs = sorted((log_dir / "tensorboard").iterdir())
    assert len(runs) == 1, f"one tracker run across every start, found {runs}"
    accumulator = event_accumulator.EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def wandb_file_records(path):
    """The records of one W&B run file (a header, then records framed as W&B's writer
    frames them: checksum, length, kind; kinds 1 full, 2 first, 3 middle, 4 last)."""
    data, position, pending = path.read_bytes(), WANDB_HEADER, b""
    assert data[:4] == b":W&B", path
    while position + WANDB_HEADER <= len(data):
        if WANDB_BLOCK - position % WANDB_BLOCK < WANDB_HEADER:
            position += WANDB_BLOCK - position % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + WANDB_HEADER])
        if kind == 0:
            break
        pending += data[position + WANDB_HEADER:position + WANDB_HEADER + length]
        position += WANDB_HEADER + length
        if kind in (1, 4):
            record = wandb_records.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(log_dir, tag: str) -> tuple[set[str], list[tuple[int, float]], list]:
    """The run ids of every W&B run file under ``log_dir``, ``tag``'s points as W&B shows
    them once synced (a later file that rewinds the run, its branch point, drops the
    earlier files' points after that step), and each file's branch point (None: none)."""
    files, ids = [], set()
    # offline-run-<start time>-<run id>/run-<run id>.wandb: in the order of the starts.
    for path in sorted((log_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        branch, points = None, {}
        ids.add(path.stem.removeprefix("run-"))
        for record in wandb_file_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                if record.run.branch_point.run:
                    assert record.run.branch_point.metric == "_step"
                    branch = record.run.branch_point.value
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                if tag in items:
                    points[items["_step"]] = items[tag]
        files.append((branch, points))
    shown: dict[int, float] = {}
    for branch, points in files:
        if branch is not None:   # rewound: what came after the branch point is dropped
            shown = {s: v for s, v in shown.items() if s <= branch}
        last = max(shown, default=0)   # W&B drops a resumed run's points at earlier steps
        shown.update({s: v for s, v in points.items() if s > last})
    return ids, sorted(shown.items()), [branch for branch, _ in files]


def mlflow_history(log_dir, ckpt, tag: str) -> list[tuple[int, float]]:
    """``tag``'s points in the MLflow run of ``ckpt``, through MLflow's own client."""
    run_id = json.loads((ckpt / "tracking.json").read_text())["mlflow_run_id"]
    client = mlflow_tracking.MlflowClient(f"sqlite:///{log_dir / 'mlflow.db'}")
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, tag),
                                              key=lambda m: (m.step, m.timestamp))]


@pytest.mark.slow
def test_a_killed_run_resumed_on_one_rank_is_one_tracker_run_with_each_point_once(
        tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    args = [*RUN, f"checkpoint.dir={ckpt}", f"log.dir={logs}"]
    log = tmp_path / "run.log"
    proc = start("train", *args, log_file=log, nproc=2)

    def killable():
        saves = [e["step"] for e in read_events(logs, "save")]
        steps = [e["step"] for e in read_events(logs, "step")]
        return saves and saves[-1] >= 10 and max(steps) >= saves[-1] + 2

    wait_until(killable, proc, "the checkpoint of step 10 and step 12", timeout=300,
               log_file=log)
    # W&B's client writes its run file every 0.5 s (trackers.WANDB_FLUSH_S): a kill within
    # that of the checkpoint's step would lose its point, a loss the tracker accepts.
    time.sleep(0.6)
    # The whole job at once, as a vanished machine: torchrun, its workers (each in a
    # session of its own) and their checkpoint processes; no signal is handled.
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    # Aimed at the checkpoint of step 10 and step 12 logged; a loaded machine may land a
    # little later: the newest checkpoint K and the last logged step M > K say where.
    saved = [e["step"] for e in read_events(logs, "save")][-1]
    logged = max(e["step"] for e in read_events(logs, "step"))
    assert 10 <= saved < logged < STEPS, (saved, logged)
    lost = range(saved + 1, logged + 1)   # logged by the dead attempt, then superseded

    run_module("train", *args, timeout=600)       # one rank, resumes from step K

    loss = scalars(logs, "train/loss")
    assert [step for step, _ in loss] == list(range(1, STEPS + 1)), loss
    resumed = {e["step"]: e["loss"] for e in read_events(logs, "step")
               if e["time"] > read_events(logs, "start")[-1]["time"]}
    assert sorted(resumed) == list(range(saved + 1, STEPS + 1))
    points = dict(loss)
    assert all(points[s] == pytest.approx(resumed[s], rel=1e-6) for s in lost)
    evals = scalars(logs, "eval/loss")
    assert [step for step, _ in evals] == [5, 10, 15, 20]
    assert [step for step, _ in scalars(logs, "checkpoint/save_s")] == [5, 10, 15, 20]

    # W&B: every start wrote the same run id; the resumed one rewound the run to step K.
    ids, wandb_loss, branches = wandb_history(logs, "train/loss")
    assert ids == {json.loads((ckpt / "tracking.json").read_text())["run_id"]}
    assert branches == [None, saved]   # the resumed start rewound the run to its checkpoint
    # From the resumed run: K+1..20 once each. Before K: what the dead attempt's W&B client
    # had written before the kill (every 0.5 s; on a loaded machine it fell behind and a
    # killed attempt lost all its points): never a point twice, never out of place.
    shown = [step for step, _ in wandb_loss]
    assert shown[shown.index(saved + 1):] == list(range(saved + 1, STEPS + 1)), wandb_loss
    assert set(shown) <= set(range(1, STEPS + 1)) and len(shown) == len(set(shown))
    assert all(dict(wandb_loss)[s] == pytest.approx(resumed[s], rel=1e-6) for s in lost)
    wandb_evals = [step for step, _ in wandb_history(logs, "eval/loss")[1]]
    assert [s for s in wandb_evals if s > saved] == [s for s in (5, 10, 15, 20) if s > saved]
    assert set(wandb_evals) <= {5, 10, 15, 20} and len(wandb_evals) == len(set(wandb_evals))
    # MLflow keeps what it is sent: each point once, the dead attempt's K+1..M never.
    mlflow_loss = mlflow_history(logs, ckpt, "train/loss")
    assert [step for step, _ in mlflow_loss] == list(range(1, STEPS + 1)), mlflow_loss
    assert all(dict(mlflow_loss)[s] == pytest.approx(resumed[s], rel=1e-6) for s in lost)
    assert [step for step, _ in mlflow_history(logs, ckpt, "eval/loss")] == [5, 10, 15, 20]

    reference = tmp_path / "reference"
    untracked = [arg for arg in RUN if not arg.startswith("log.trackers")]
    torchrun(2, "train", *untracked, f"checkpoint.dir={reference / 'ckpt'}",
             f"log.dir={reference / 'logs'}", timeout=600)
    expected = {e["step"]: e["eval_loss"] for e in read_events(reference / "logs", "eval")}
    assert evals[-1][1] == pytest.approx(expected[STEPS], rel=1e-5)


LR = {"lr": 0.1}
PARAMS = {"train": LR}


def test_mlflow_gets_a_step_once_its_checkpoint_is_committed(tmp_path, monkeypatch):
    """MLflow cannot drop a point: what a crash would make the resumed run log again is
    held back until the checkpoint covering it commits."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers = project_module("tracking.trackers")
    storage = project_module("checkpoint.store.storage").open_storage(str(tmp_path / "ckpt"))
    Event = project_module("runtime.metrics").Event
    logs = str(tmp_path / "logs")

    def loss(step: int, value: float) -> tuple:
        return Event.step, {"step": step, "loss": value}

    first = trackers.open_trackers(["mlflow"], logs, storage, None, PARAMS)
    for event in [loss(s, float(s)) for s in range(1, 7)]:
        first[0].log(*event)
    first[0].log(Event.save, {"step": 4, "write_s": 0.5})
    assert [s for s, _ in mlflow_history(tmp_path / "logs", tmp_path / "ckpt",
                                         "train/loss")] == [1, 2, 3, 4]
    first[0].close()   # a crash after step 6: 5 and 6 are never sent
    second = trackers.open_trackers(["mlflow"], logs, storage, 4, PARAMS)
    for event in [loss(s, 10.0 + s) for s in range(5, 9)]:
        second[0].log(*event)
    second[0].log(Event.save, {"step": 8, "write_s": 0.5})
    second[0].close()
    history = mlflow_history(tmp_path / "logs", tmp_path / "ckpt", "train/loss")
    assert history == [(s, float(s)) for s in range(1, 5)] + [(s, 10.0 + s) for s in range(5, 9)]
    assert [s for s, _ in mlflow_history(tmp_path / "logs", tmp_path / "ckpt",
                                         "checkpoint/save_s")] == [4, 8]


def test_a_tracker_that_cannot_start_or_fails_leaves_training_alone(tmp_path, monkeypatch,
                                                                    capfd):
    trackers = project_module("tracking.trackers")
    storage = project_module("checkpoint.store.storage").open_storage(str(tmp_path / "ckpt"))
    Event = project_module("runtime.metrics").Event
    # An MLflow server that is not there: left out with one line, no exception.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    assert trackers.open_trackers(["mlflow"], str(tmp_path / "logs"), storage, None, {}) == []
    assert "log.trackers: mlflow could not start" in capfd.readouterr().err
    # A tracker whose package is missing is a configuration error (exit 2, its extra named).
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(project_module("config").ConfigError, match=r"'\.\[wandb\]'"):
        trackers.open_trackers(["wandb"], str(tmp_path / "logs"), storage, None, {})

    class Broken:
        def log(self, kind, fields):
            raise OSError("no space left on device")

        def close(self):
            raise AssertionError("a dropped tracker is not closed")

    guarded = trackers.Guarded("tensorboard", Broken())
    guarded.log(Event.step, {"step": 1, "loss": 1.0})
    guarded.log(Event.step, {"step": 2, "loss": 1.0})   # dropped: not called again
    guarded.close()
    err = capfd.readouterr().err
    assert err.count("log.trackers: tensorboard failed (OSError: no space left") == 1
