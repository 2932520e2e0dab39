"""Warm start: ``resume``'s workers are forked from a pre-imported process (the zygote).

Checked on real launches: the workers of a first start and of an in-place restart, and
their DCP checkpoint processes, are the zygote's children; a zygote holding a thread is refused, in one line, and the run
trains cold; nothing of a launch, the zygote included, outlives ``resume`` or a SIGKILL
of the zygote or of a worker's stand-in; ``recovery.warm_start=false`` starts no zygote.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    PACKAGE,
    cmdline,
    descendants,
    finish,
    gone,
    overrides_for,
    parents,
    project_module,
    read_events,
    start,
    suite_env,
    wait_until,
)

SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=10",
         "checkpoint.interval_steps=5", "eval.at_end=false"]
overrides = overrides_for(*SMALL)
ZYGOTE = f"{PACKAGE}.launch.zygote".encode()


def running_workers(logs: Path, since: float, count: int = 2) -> dict[int, int] | None:
    """{rank: pid} of the ranks that record a running start after ``since``."""
    records = project_module("recovery.attempts").read_records(logs)
    found = {r["rank"]: int(r["pid"]) for r in records
             if r.get("state") == "running" and r.get("started", 0) >= since
             and not gone(int(r["pid"]))}
    return found if len(found) == count else None


def parent_command(pid: int) -> bytes:
    return cmdline(parents().get(pid, 0))


def launch(run_dirs, tmp_path, *extra, steps=100000, env=None):
    log = tmp_path / "resume.log"
    proc = start("resume", "--nproc-per-node", "2", *overrides(run_dirs, *extra),
                 f"train.max_steps={steps}", log_file=log, env=env)
    return proc, log, Path(run_dirs["logs"])


def stop(proc) -> int:
    os.killpg(proc.pid, signal.SIGTERM)
    return finish(proc, 120)


@pytest.mark.slow
def test_workers_are_forked_from_the_zygote_at_a_start_and_an_in_place_restart(
        run_dirs, tmp_path):
    began = time.time()
    proc, log, logs = launch(run_dirs, tmp_path)
    family = []
    try:
        first = wait_until(lambda: running_workers(logs, began - 1), proc, "two workers",
                           log_file=log)
        for pid in first.values():
            assert ZYGOTE in parent_command(pid), (pid, parent_command(pid))
        family = [*descendants(proc.pid)]
        wait_until(lambda: read_events(logs, "save"), proc, "a checkpoint", log_file=log)
        # DCP's checkpoint process of each worker is forked by the zygote too, not spawned
        # (a new Python importing torch again).
        zygote = parents()[first[0]]
        assert [cmdline(p)[:80] for p in descendants(proc.pid)
                if b"multiprocessing" in cmdline(p)] == []
        assert len([p for p, parent in parents().items() if parent == zygote]) == 4
        killed = time.time()
        os.kill(first[1], signal.SIGKILL)
        again = wait_until(lambda: running_workers(logs, killed), proc,
                           "the restarted workers", log_file=log)
        assert set(again.values()).isdisjoint(first.values())
        for pid in again.values():
            assert ZYGOTE in parent_command(pid), (pid, parent_command(pid))
        recovered = wait_until(lambda: read_events(logs, "recovered"), proc,
                               "a recovered event", log_file=log)
        assert recovered[-1]["failure_to_first_step_s"] > 0
        family += descendants(proc.pid)
    finally:
        code = stop(proc)
    text = log.read_text(errors="replace")
    assert code == 75, text[-4000:]
    # A stand-in passes its worker's status on as its own: no traceback of its own.
    assert "in start_if_asked" not in text, text[-4000:]
    assert all(map(gone, family)), [cmdline(p)[:80] for p in family if not gone(p)]


@pytest.mark.slow
def test_a_zygote_holding_a_thread_is_refused_in_one_line_and_the_run_trains_cold(
        run_dirs, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    # A library that starts a thread at import, as some trackers do: every process of
    # the launch runs it, the zygote included.
    (site / "sitecustomize.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True,\n"
        "                 name='started-at-import').start()\n")
    env = {"PYTHONPATH": f"{site}{os.pathsep}{suite_env()['PYTHONPATH']}"}
    began = time.time()
    proc, log, logs = launch(run_dirs, tmp_path, steps=12, env=env)
    workers = wait_until(lambda: running_workers(logs, began - 1), proc, "two workers",
                         log_file=log)
    for pid in workers.values():
        assert ZYGOTE not in parent_command(pid)
    assert finish(proc, 300) == 0, log.read_text(errors="replace")[-4000:]
    text = log.read_text(errors="replace")
    refusals = [line for line in text.splitlines() if line.startswith("warm start:")]
    refused = ("warm start: refused: a Python thread was started at import "
               "(started-at-import): workers start cold")
    assert refusals == [refused], text[-4000:]


def test_a_zygote_that_initialised_cuda_is_refused(monkeypatch):
    zygote = project_module("launch.zygote")
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA" in zygote.fork_hazard(zygote._threads())


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["zygote", "stand-in"])
def test_nothing_of_the_launch_outlives_a_sigkill_of_the_zygote_or_a_stand_in(
        run_dirs, tmp_path, victim):
    began = time.time()
    proc, log, logs = launch(run_dirs, tmp_path, steps=60)
    workers = wait_until(lambda: running_workers(logs, began - 1), proc, "two workers",
                         log_file=log)
    zygote = parents()[workers[0]]
    stand_in = next(pid for pid in descendants(proc.pid)
                    if f"{PACKAGE}.train".encode() in cmdline(pid)
                    and not any(name in cmdline(pid) for name in (ZYGOTE, b"launch.agent")))
    family = [proc.pid, *descendants(proc.pid)]
    assert zygote in family
    killed = time.time()
    os.kill(zygote if victim == "zygote" else stand_in, signal.SIGKILL)
    if victim == "stand-in":   # the zygote outlives its worker's stand-in and forks again
        again = wait_until(lambda: running_workers(logs, killed), proc,
                           "the restarted workers", log_file=log)
        assert all(parents().get(pid) == zygote for pid in again.values()), again
    code = finish(proc, 300)
    text = log.read_text(errors="replace")
    family += descendants(proc.pid)
    assert all(map(gone, family)), [cmdline(p)[:80] for p in family if not gone(p)]
    assert code == 0, text[-4000:]
    assert read_events(logs, "step")[-1]["step"] == 60


@pytest.mark.slow
def test_warm_start_false_starts_no_zygote(run_dirs, tmp_path):
    began = time.time()
    proc, log, logs = launch(run_dirs, tmp_path, "recovery.warm_start=false", steps=12)
    workers = wait_until(lambda: running_workers(logs, began - 1), proc, "two workers",
                         log_file=log)
    for pid in workers.values():
        assert b"launch.agent" in parent_command(pid)
    assert not [p for p in descendants(proc.pid) if ZYGOTE in cmdline(p)]
    assert finish(proc, 300) == 0, log.read_text(errors="replace")[-4000:]


def test_a_rank_waits_for_rank_0s_store_instead_of_torchs_retry_delay():
    """A new worker that gets to the rendezvous before rank 0's has started its store
    connects once the store listens (torch's own client retries only after 0.3 s or
    more), and gives up at its bound, leaving the error to init_process_group."""
    import socket
    import threading

    distributed = project_module("runtime.distributed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    distributed._wait_for_store("127.0.0.1", port, 0.05)   # nothing listens: bounded
    accepted = []

    def store_starts_late() -> None:
        time.sleep(0.2)
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            server.settimeout(10)
            accepted.append(server.accept()[0])

    thread = threading.Thread(target=store_starts_late)
    thread.start()
    distributed._wait_for_store("127.0.0.1", port, 30.0)
    thread.join(15)
    assert accepted, "the wait gave up before the store listened"
    accepted[0].close()
