"""Stops that are not preemptions: Ctrl-C (once, twice) and a launcher that dies.

Ctrl-C is the user's own stop: the state is saved as on a preemption, but it is called
what it is and exits 130; a second Ctrl-C leaves at once, without the final save. A
worker whose torchrun has died stops at the next step boundary instead of training on
as an orphan.
"""

import os
import signal
import subprocess
import sys
import threading
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


# ------------------------------------------- a decided status ends the job --
class _Watch:
    def __init__(self, requested=None):
        self.requested = requested


class _Stop:
    """What ``_no_restart_in_place`` reads of the StopCoordinator; ``torchrun_pid`` is a
    sleeping child standing in for torchrun."""

    def __init__(self, torchrun_pid, requested=None):
        self.launcher_pid, self.torchrun_pid = os.getppid(), torchrun_pid
        self.watch, self.signals_received = _Watch(requested), 0


def _decide(local_rank, stop, decided_at):
    job = project_module("loop.job")
    runtime = type("Runtime", (), {"local_rank": local_rank})()
    attempt = type("Attempt", (), {"restarts_left": 3})()
    job._no_restart_in_place(73, stop, runtime, attempt, decided_at)


def test_a_decided_status_asks_torchrun_to_stop_even_after_its_sigterm_came_back(tmp_path):
    """Local rank 0 asks torchrun to stop though a SIGTERM reached it after the decision
    (torchrun stopping the workers to restart them, another rank having exited first);
    a signal from before the decision means torchrun is stopping already."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        request = project_module("preemption.watch").StopRequest
        decided = time.time()
        _decide(0, _Stop(stand_in.pid, request("SIGTERM", decided - 5)), decided)
        assert stand_in.poll() is None            # signalled before: not asked again
        _decide(0, _Stop(stand_in.pid, request("SIGTERM", decided + 0.5)), decided)
        assert stand_in.wait(timeout=10) == -signal.SIGTERM
    finally:
        stand_in.kill()


def test_the_other_ranks_wait_for_torchrun_to_be_asked_before_they_exit(monkeypatch):
    """A rank other than local rank 0 exits only once the SIGTERM of the ask came back
    (bounded): exiting first, torchrun would take it for a crash and restart in place."""
    job = project_module("loop.job")
    monkeypatch.setattr(job, "ASK_WAIT_S", 1.5)
    stop = _Stop(torchrun_pid=0)
    began = time.monotonic()
    _decide(1, stop, time.time())                 # nothing comes: waits out the bound
    assert 1.4 < time.monotonic() - began < 5
    began = time.monotonic()
    threading.Timer(0.3, lambda: setattr(stop, "signals_received", 1)).start()
    _decide(1, stop, time.time())
    assert 0.25 < time.monotonic() - began < 1.4
