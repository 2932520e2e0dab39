"""No worker outlives its launcher.

Plain ``torchrun`` (what every tutorial shows: no ``--signals-to-handle``) dies of a
SIGUSR1, and its workers are re-parented; nobody will signal them again. Each worker
sees its launcher gone within a second, stops as on a preemption (a final checkpoint)
and exits; one that cannot reach a step boundary (here: blocked writing to an output
pipe nobody reads any more) is ended by its own launcher watch before the grace period
is over, DCP's checkpoint process and every other child with it.
"""

import fcntl
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
    ROOT,
    cmdline,
    descendants,
    overrides_for,
    project_module,
    read_events,
    suite_env,
    wait_gone,
    wait_until,
)

GRACE_S = 12.0
overrides = overrides_for("model.d_model=32", "model.n_layers=1", "train.max_steps=100000",
                          "checkpoint.interval_steps=5", f"preemption.grace_period_s={GRACE_S}")


def plain_torchrun(args: list[str], **popen) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node 2 -m <package>.train args``, as tutorials
    write it: none of the project's launch flags."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "-m", f"{PACKAGE}.train", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=suite_env(), start_new_session=True, **popen)


def workers_of(proc: subprocess.Popen) -> list[int]:
    return [pid for pid in descendants(proc.pid) if f"{PACKAGE}.train".encode() in cmdline(pid)]


def committed(ckpt_dir: str) -> list[int]:
    checkpoint = project_module("checkpoint")
    return [c.step for c in checkpoint.list_committed(checkpoint.open_storage(ckpt_dir),
                                                        warn=False)]


@pytest.mark.slow
def test_sigusr1_to_plain_torchrun_stops_its_workers_with_a_final_save(run_dirs, tmp_path):
    log = tmp_path / "job.log"
    with open(log, "w", encoding="utf-8") as out:
        proc = plain_torchrun(overrides(run_dirs), stdout=out, stderr=subprocess.STDOUT)
    logs = Path(run_dirs["logs"])
    wait_until(lambda: read_events(logs, "save"), proc, "a first checkpoint", log_file=log)
    family = descendants(proc.pid)
    assert len(workers_of(proc)) == 2
    proc.send_signal(signal.SIGUSR1)     # torchrun's default action for it: die
    proc.wait(timeout=30)
    wait_gone(family, timeout=30)        # the workers and their children (DCP's process)
    stop = read_events(logs, "preemption")[-1]
    assert stop["source"] == "launcher-gone"
    assert committed(run_dirs["ckpt"])[-1] == stop["stop_step"]
    assert "Traceback" not in log.read_text().split("stop requested", 1)[-1]


@pytest.mark.slow
def test_a_worker_that_cannot_reach_a_step_boundary_ends_itself_in_the_grace(run_dirs):
    """Its output pipe is full and nobody reads it: the main thread blocks in a write and
    never reaches the next vote. The launcher watch ends it, children first."""
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 4096)   # fills within a few dozen steps
    proc = plain_torchrun([*overrides(run_dirs), "log.every_steps=1"], stdout=write_fd,
                          stderr=write_fd)
    os.close(write_fd)
    lines: list[bytes] = []
    reading = threading.Event()
    reading.set()

    def read() -> None:   # like a log collector that stops reading
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while reading.is_set():
                chunk = pipe.read(512)
                if not chunk:
                    return
                lines.append(chunk)
            time.sleep(3600)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    logs = Path(run_dirs["logs"])
    wait_until(lambda: read_events(logs, "save"), proc, "a first checkpoint")
    reading.clear()                      # from now on the pipe fills up
    steps = len(read_events(logs, "step"))
    wait_until(lambda: _stalled(logs, steps), proc, "the workers blocked on their output",
               timeout=120)
    family = descendants(proc.pid)
    newest = committed(run_dirs["ckpt"])[-1]
    os.kill(proc.pid, signal.SIGKILL)    # the launcher dies; nobody forwards anything
    proc.wait(timeout=30)
    seconds = wait_gone(family, timeout=GRACE_S + 15)
    assert seconds < GRACE_S, f"the workers took {seconds:.1f} s, the grace is {GRACE_S:g} s"
    assert committed(run_dirs["ckpt"])[-1] >= newest   # nothing committed was lost
    check = subprocess.run([sys.executable, "-m", f"{PACKAGE}.verify",
                            f"checkpoint.dir={run_dirs['ckpt']}"], cwd=ROOT, env=suite_env(),
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


ARMED = """
import os, sys, time
from {package}.preemption.launcher import LauncherWatch
from {package}.preemption.watch import PreemptionWatch
watch = PreemptionWatch(signals=())
guard = LauncherWatch(watch, os.getpid(), grace_s=0.0, status=lambda: 3, poll_s=0.01).start()
while watch.requested is None:      # never this process's parent: seen gone at once
    time.sleep(0.01)
guard.stop()                        # the main thread ends on its own from here...
time.sleep(60)                      # ...and blocks on its way out (a full output pipe)
"""


def test_a_hard_end_once_armed_outlasts_the_end_of_training():
    """Seen in CI: the launcher gone, one rank ended by its watch; the other's collective
    failed, its ``finally`` stopped its watch, and its traceback blocked on the full pipe
    for good. A stop after the launcher was seen gone keeps the hard end."""
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", ARMED.format(package=PACKAGE)],
                          check=False, cwd=ROOT,
                          env=suite_env(), capture_output=True, text=True, timeout=20)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - began < 20
    assert "is gone and this worker did not end within 3 s" in proc.stderr


def _stalled(logs: Path, before: int) -> bool:
    """No new step event for two seconds (rank 0 is blocked on its output)."""
    first = len(read_events(logs, "step"))
    if first <= before:
        return False
    time.sleep(2.0)
    return len(read_events(logs, "step")) == first
