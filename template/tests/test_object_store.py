"""Checkpoints in an object store: no rename, so commit.json written last decides.

The S3 tests run against moto's S3 server on 127.0.0.1; the protocol tests use fsspec's
in-memory filesystem.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import moto_s3, read_metrics, torchrun

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


def test_object_store_commit_needs_no_rename(ckpt, memory_store):
    layout, _ = ckpt
    fake_save(memory_store, 4)
    assert layout.newest_complete_checkpoint(memory_store) is None   # shards, no commit file
    committed = layout.commit(memory_store, 4, {"world_size": 2})
    assert committed.name == "step_000000004"
    assert layout.newest_complete_checkpoint(memory_store).step == 4


def test_object_store_retention_and_leftovers(ckpt, memory_store):
    layout, _ = ckpt
    for step in (1, 2, 3):
        fake_save(memory_store, step)
        layout.commit(memory_store, step, {"world_size": 2})
    fake_save(memory_store, 4)                                       # interrupted save
    assert layout.retire_old(memory_store, keep_last=1) == ["step_000000001", "step_000000002"]
    assert layout.clean_leftovers(memory_store) == ["step_000000004"]
    assert memory_store.list_names() == ["step_000000003"]


def test_object_store_truncated_shard_is_skipped(ckpt, memory_store):
    layout, _ = ckpt
    for step in (1, 2):
        fake_save(memory_store, step)
        layout.commit(memory_store, step, {"world_size": 2})
    memory_store.fs.pipe_file(memory_store._key("step_000000002/__0_0.distcp"), b"short")
    assert layout.newest_complete_checkpoint(memory_store).step == 1


@pytest.fixture
def s3_bucket(monkeypatch):
    """A bucket on a local moto S3 server; the environment points every client at it."""
    server = moto_s3(monkeypatch, "ckpt-bucket")
    yield "s3://ckpt-bucket/run"
    server.stop()


@pytest.mark.slow
def test_two_ranks_save_to_s3_and_resume(s3_bucket, tmp_path):
    logs = tmp_path / "logs"
    args = ["model.d_model=32", "model.n_layers=1", "checkpoint.interval_steps=4",
            "checkpoint.keep_last=1", f"checkpoint.dir={s3_bucket}", f"log.dir={logs}"]
    torchrun(2, "train", "train.max_steps=8", *args)
    s3 = fsspec.filesystem("s3", skip_instance_cache=True)
    assert [p.rsplit("/", 1)[-1] for p in s3.ls("ckpt-bucket/run", refresh=True)] == [
        "step_000000008"]
    names = {p.rsplit("/", 1)[-1] for p in s3.ls("ckpt-bucket/run/step_000000008")}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "commit.json"} <= names
    record = json.loads(s3.cat_file("ckpt-bucket/run/step_000000008/commit.json"))
    assert record["step"] == 8 and record["world_size"] == 2

    torchrun(2, "train", "train.max_steps=10", *args)
    starts = [e for e in read_metrics(Path(logs)) if e["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 8]


def test_object_store_resave_of_a_step_drops_its_old_commit_first(ckpt, memory_store):
    """Shards of a new save must never sit under an old commit.json that vouches for them."""
    layout, _ = ckpt
    fake_save(memory_store, 6)
    layout.commit(memory_store, 6, {"world_size": 1})
    layout.make_room(memory_store, 6)
    assert memory_store.size("step_000000006/commit.json") is None
    assert layout.newest_complete_checkpoint(memory_store) is None
