"""Experiment trackers across a crash: one tracker run, each step's point exactly once.

Read back with the tracker's own reader (TensorBoard's EventAccumulator).
"""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from conftest import descendants, read_events, run_module, start, torchrun, wait_until

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")

STEPS = 20
# Steps of a few tenths of a second: the kill lands between step 12 and the save of 15.
RUN = ["model.d_model=96", "model.n_layers=2", "train.micro_batch_size=4",
       f"train.max_steps={STEPS}", "checkpoint.interval_steps=5", "eval.every_steps=5",
       "eval.max_batches=8", "log.trackers=[tensorboard]", "log.every_steps=1"]


def scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point of ``tag`` in the one tracker run under ``log_dir``."""
    runs = sorted((log_dir / "tensorboard").iterdir())
    assert len(runs) == 1, f"one tracker run across every start, found {runs}"
    accumulator = event_accumulator.EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


@pytest.mark.slow
def test_a_killed_run_resumed_on_one_rank_is_one_tensorboard_run_with_each_point_once(
        tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    args = [*RUN, f"checkpoint.dir={ckpt}", f"log.dir={logs}"]
    log = tmp_path / "run.log"
    proc = start("train", *args, log_file=log, nproc=2)

    def killable():
        saves = [e["step"] for e in read_events(logs, "save")]
        steps = [e["step"] for e in read_events(logs, "step")]
        return saves and saves[-1] == 10 and max(steps) >= 12

    wait_until(killable, proc, "the checkpoint of step 10 and step 12", timeout=300,
               log_file=log)
    # The whole job at once, as a vanished machine: torchrun, its workers (each in a
    # session of its own) and their checkpoint processes; no signal is handled.
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert [e["step"] for e in read_events(logs, "save")][-1] == 10, "killed too late"
    assert max(e["step"] for e in read_events(logs, "step")) < 15

    run_module("train", *args, timeout=600)       # one rank, resumes from step 10

    loss = scalars(logs, "train/loss")
    assert [step for step, _ in loss] == list(range(1, STEPS + 1)), loss
    resumed = {e["step"]: e["loss"] for e in read_events(logs, "step")
               if e["time"] > read_events(logs, "start")[-1]["time"]}
    assert sorted(resumed) == list(range(11, STEPS + 1))
    points = dict(loss)
    assert all(points[s] == pytest.approx(resumed[s], rel=1e-6) for s in (11, 12))
    evals = scalars(logs, "eval/loss")
    assert [step for step, _ in evals] == [5, 10, 15, 20]
    assert [step for step, _ in scalars(logs, "checkpoint/save_s")] == [5, 10, 15, 20]

    reference = tmp_path / "reference"
    torchrun(2, "train", *RUN, f"checkpoint.dir={reference / 'ckpt'}",
             f"log.dir={reference / 'logs'}", timeout=600)
    expected = {e["step"]: e["eval_loss"] for e in read_events(reference / "logs", "eval")}
    assert evals[-1][1] == pytest.approx(expected[STEPS], rel=1e-5)
