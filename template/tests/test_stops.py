"""Stops that are not preemptions: Ctrl-C (once, twice) and a launcher that dies.

Ctrl-C is the user's own stop: the state is saved as on a preemption, but it is called
what it is and exits 130; a second Ctrl-C leaves at once, without the final save. A
worker whose torchrun has died stops at the next step boundary instead of training on
as an orphan.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    PACKAGE,
    children,
    cmdline,
    finish,
    gone,
    overrides_for,
    project_module,
    read_events,
    start,
    wait_until,
)

SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=1000",
         "train.max_steps=100000", "checkpoint.interval_steps=5"]
INTERRUPTED = project_module("runtime.exit_codes").INTERRUPTED


overrides = overrides_for(*SMALL)


def committed(dirs) -> list[int]:
    storage = project_module("checkpoint").open_storage(dirs["ckpt"])
    return [c.step for c in project_module("checkpoint").list_committed(storage, warn=False)]


@pytest.mark.torch_api
def test_ctrl_c_saves_and_says_it_was_the_user(run_dirs, tmp_path):
    log = tmp_path / "job.log"
    proc = start("train", *overrides(run_dirs), log_file=log)
    logs = Path(run_dirs["logs"])
    wait_until(lambda: len(read_events(logs, "step")) >= 3, proc, "three steps", log_file=log)
    proc.send_signal(signal.SIGINT)
    assert finish(proc, timeout=120) == INTERRUPTED
    output = log.read_text()
    assert "interrupted by the user" in output and "preempted" not in output
    stop = read_events(logs, "preemption")[-1]
    assert stop["source"] == "SIGINT" and stop["final_checkpoint_step"] == stop["stop_step"]
    assert committed(run_dirs)[-1] == stop["stop_step"]


@pytest.mark.torch_api
def test_a_second_ctrl_c_exits_at_once_without_the_final_save(run_dirs, tmp_path):
    log = tmp_path / "job.log"
    # Synchronous saves of a larger model: the final save takes long enough to interrupt.
    proc = start("train", *overrides(run_dirs, "checkpoint.async_mode=sync",
                                     "model.d_model=256", "model.n_layers=4"), log_file=log)
    logs = Path(run_dirs["logs"])
    wait_until(lambda: read_events(logs, "save"), proc, "a first checkpoint", timeout=300,
               log_file=log)
    before = committed(run_dirs)
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: "interrupted by the user" in log.read_text(), proc, "the stop",
               log_file=log)
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    assert finish(proc, timeout=60) == INTERRUPTED
    assert time.monotonic() - began < 10
    assert "second Ctrl-C: exiting now without a final save" in log.read_text()
    assert committed(run_dirs)[-1] in before or committed(run_dirs)[-1] == before[-1]


@pytest.mark.slow
def test_workers_stop_when_their_torchrun_dies(run_dirs, tmp_path):
    log = tmp_path / "job.log"
    proc = start("train", *overrides(run_dirs), log_file=log, nproc=2)
    logs = Path(run_dirs["logs"])
    wait_until(lambda: len(read_events(logs, "step")) >= 3, proc, "three steps", log_file=log)
    workers = [pid for pid in children(proc.pid) if f"{PACKAGE}.train".encode() in cmdline(pid)]
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)          # the launcher dies; nobody forwards anything
    proc.wait()
    deadline = time.monotonic() + 90
    while not all(map(gone, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(gone, workers)), "workers trained on after their torchrun died"
    stop = read_events(logs, "preemption")[-1]
    assert stop["source"] == "launcher-gone"
    assert committed(run_dirs)[-1] == stop["stop_step"]
