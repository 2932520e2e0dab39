"""Faults around saving: no wait without a bound, no false success, one writer per directory.

Each test uses the real component: torchrun and DCP's own checkpoint process (killed
while it starts), a size-limited tmpfs (a full disk), two real jobs on one directory.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import (
    checkpoint_process_rank,
    descendants,
    finish,
    overrides_for,
    project_module,
    read_events,
    run_module,
    start,
    torchrun,
    wait_until,
)

SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=2"]
EXIT_NOT_SAVED = project_module("runtime.exit_codes").NOT_SAVED


overrides = overrides_for(*SMALL)


# ------------------------------------------------ a checkpoint process that dies --
def _checkpoint_processes(job: int, rank: str) -> list[int]:
    """DCP's background checkpoint processes of one rank of the job started as ``job``."""
    return [pid for pid in descendants(job) if checkpoint_process_rank(pid) == rank]


@pytest.mark.slow
def test_a_checkpoint_process_killed_while_it_starts_costs_no_hang(run_dirs, tmp_path):
    """Rank 1's checkpoint process dies as it starts; rank 0's then waits for a peer that
    never comes. The start-up wait is bounded, every rank falls back to synchronous saves,
    and the run finishes with every checkpoint committed, well inside a bounded time."""
    log = tmp_path / "job.log"
    killed: list[int] = []
    stop = threading.Event()

    job: list[int] = []

    def kill_rank1_checkpoint_process():
        while not stop.is_set() and not killed:
            for pid in _checkpoint_processes(job[0], "1") if job else ():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_rank1_checkpoint_process, daemon=True)
    watcher.start()
    began = time.monotonic()
    proc = start("train", *overrides(run_dirs, "train.max_steps=6", "checkpoint.interval_steps=3",
                                     "checkpoint.start_timeout_s=15",
                                     "checkpoint.wait_timeout_s=20"),
                 log_file=log, nproc=2)
    job.append(proc.pid)
    try:
        code = finish(proc, timeout=150)
    finally:
        stop.set()
    elapsed = time.monotonic() - began
    output = log.read_text()
    assert killed, "the test never saw rank 1's checkpoint process"
    assert code == 0, output[-4000:]
    assert "saving synchronously from now on" in output
    assert elapsed < 120, f"took {elapsed:.0f} s"
    saves = read_events(Path(run_dirs["logs"]), "save")
    assert [(e["step"], e["mode"]) for e in saves] == [(3, "sync"), (6, "sync")]
    changed = read_events(Path(run_dirs["logs"]), "save_mode_changed")
    assert changed and "did not start" in changed[0]["reason"]


# ------------------------------------------------------------- a full disk --
@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for one checkpoint of the default model (1.9 MB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_final_save_that_does_not_commit_is_not_a_success(small_disk, tmp_path):
    """The disk fills up at the final save: the run must not exit 0 ("finished") while the
    newest committed checkpoint is an older step; it exits 73 and says so."""
    dirs = {"ckpt": str(small_disk / "ckpt"), "logs": str(tmp_path / "logs")}
    proc = run_module("resume", "--nproc-per-node", "2", "log.every_steps=2",
                      f"checkpoint.dir={dirs['ckpt']}", f"log.dir={dirs['logs']}",
                      "train.max_steps=6", "checkpoint.interval_steps=3",
                      "checkpoint.keep_last=5", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NOT_SAVED, output[-4000:]
    assert "NOT saved" in output and "newest committed checkpoint is step 3" in output
    assert "finished at step" not in output
    assert "No space left on device" in output or "ENOSPC" in output or "errno 28" in output
    storage = project_module("checkpoint").open_storage(dirs["ckpt"])
    assert [c.step for c in project_module("checkpoint").list_committed(storage)] == [3]


@pytest.mark.slow
def test_saves_failing_in_a_row_stop_training_with_the_not_saved_status(small_disk, tmp_path):
    dirs = {"ckpt": str(small_disk / "ckpt"), "logs": str(tmp_path / "logs")}
    proc = run_module("resume", "--nproc-per-node", "1", "log.every_steps=2",
                      f"checkpoint.dir={dirs['ckpt']}", f"log.dir={dirs['logs']}",
                      "train.max_steps=40", "checkpoint.interval_steps=2",
                      "checkpoint.keep_last=5", "checkpoint.max_failed_saves=2",
                      "checkpoint.max_failed_saves_s=0", check=False)   # the count alone
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NOT_SAVED, output[-4000:]
    assert "2 save(s) in a row failed, the last: " in output
    steps = [e["step"] for e in read_events(Path(dirs["logs"]), "step")]
    assert max(steps) < 40          # it stopped instead of training on unsaved


# ------------------------------------------------------ one writer per directory --
def _lease(dirs) -> dict:
    return json.loads((Path(dirs["ckpt"]) / "lease.json").read_text())


@pytest.mark.slow
def test_a_second_job_on_the_same_directory_is_refused(run_dirs, tmp_path):
    first = start("train", *overrides(run_dirs, "train.max_steps=100000",
                                      "checkpoint.interval_steps=50"),
                  log_file=tmp_path / "first.log", nproc=2)
    try:
        wait_until(lambda: read_events(Path(run_dirs["logs"]), "step"), first, "training",
                   log_file=tmp_path / "first.log")
        owner = _lease(run_dirs)
        second_logs = tmp_path / "second-logs"
        proc = run_module("resume", "--nproc-per-node", "2", *SMALL,
                          f"checkpoint.dir={run_dirs['ckpt']}", f"log.dir={second_logs}",
                          "checkpoint.lease_wait_s=2", check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"is in use by job {owner['job_id']}" in proc.stderr
        assert f"pid {owner['pid']}" in proc.stderr and "Traceback" not in proc.stderr
        assert first.poll() is None           # the first job trains on, untouched
        assert _lease(run_dirs)["pid"] == owner["pid"]
    finally:
        first.send_signal(signal.SIGTERM)
        finish(first, timeout=120)
    assert not (Path(run_dirs["ckpt"]) / "lease.json").exists()   # released at the end


@pytest.mark.torch_api
def test_a_stale_lease_is_taken_over_with_a_notice(run_dirs):
    ckpt = Path(run_dirs["ckpt"])
    ckpt.mkdir(parents=True)
    now = time.time()
    (ckpt / "lease.json").write_text(json.dumps({
        "host": "gone-host", "pid": 1, "job_id": "old-job", "acquired": now - 900,
        "heartbeat": now - 600}))
    proc = torchrun(1, "train", *overrides(run_dirs, "train.max_steps=2",
                                           "checkpoint.async_mode=sync"))
    assert "took over the lease of job old-job (host gone-host" in proc.stdout
    assert re.search(r"no heartbeat for 6[0-9][0-9] s", proc.stdout)


@pytest.mark.torch_api
def test_a_restart_waits_for_the_previous_owner_to_finish(run_dirs):
    """A live holder on this host (here: a process that ends after 3 s, as a job draining
    its last save would) is waited for, within checkpoint.lease_wait_s, then replaced."""
    ckpt = Path(run_dirs["ckpt"])
    ckpt.mkdir(parents=True)
    holder = subprocess.Popen(["sleep", "3"])
    now = time.time()
    (ckpt / "lease.json").write_text(json.dumps({
        "host": socket.gethostname(), "pid": holder.pid, "job_id": "previous",
        "acquired": now, "heartbeat": now}))
    threading.Thread(target=holder.wait, daemon=True).start()   # reap it when it ends
    began = time.monotonic()
    proc = torchrun(1, "train", *overrides(run_dirs, "train.max_steps=2",
                                           "checkpoint.async_mode=sync",
                                           "checkpoint.lease_wait_s=30"))
    assert time.monotonic() - began >= 3
    assert "finished at step 2" in proc.stdout
    assert f"process {holder.pid} on this host has ended" in proc.stdout
    shutil.rmtree(ckpt)
