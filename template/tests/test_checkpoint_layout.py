"""The layout of checkpoint.dir on plain files: what counts as a checkpoint and what does not."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api


def fake_save(root, layout, step, storage):
    """A real (one-process) DCP save into the staging directory: a shard and .metadata."""
    work = layout.staging_name(step, storage)
    dcp.save({"w": torch.arange(250.0)}, storage_writer=storage.writer(work), no_dist=True)


def committed_steps(layout, storage):
    return [c.step for c in layout.list_committed(storage)]


def test_commit_writes_commit_file_last_and_renames_into_place(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    fake_save(tmp_path, layout, 5, storage)
    assert committed_steps(layout, storage) == []          # written but not committed
    layout.commit(storage, 5, {"world_size": 2, "reason": "interval"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000005"]
    record = json.loads((tmp_path / "step_000000005" / "commit.json").read_text())
    shard = tmp_path / "step_000000005" / "__0_0.distcp"
    assert record["step"] == 5 and record["files"]["__0_0.distcp"]["size"] == shard.stat().st_size
    assert committed_steps(layout, storage) == [5]


def test_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, ckpt, caplog):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    for step in (10, 20, 30):
        fake_save(tmp_path, layout, step, storage)
        layout.commit(storage, step, {"world_size": 1})
    (tmp_path / "step_000000030" / "commit.json").unlink()
    assert layout.newest_complete_checkpoint(storage).step == 20
    with open(tmp_path / "step_000000020" / ".metadata", "r+b") as handle:
        handle.truncate(10)
    assert layout.newest_complete_checkpoint(storage).step == 10
    (tmp_path / "step_000000010" / "commit.json").write_text("{not json")
    assert layout.newest_complete_checkpoint(storage) is None
    assert "skipping checkpoint" in caplog.text and ".metadata is 10 bytes" in caplog.text


def test_missing_shard_makes_a_checkpoint_incomplete(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    fake_save(tmp_path, layout, 1, storage)
    layout.commit(storage, 1, {"world_size": 2})
    (tmp_path / "step_000000001" / "__0_0.distcp").unlink()
    assert layout.newest_complete_checkpoint(storage) is None


def test_retention_keeps_the_newest_committed(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    for step in (1, 2, 3, 4):
        fake_save(tmp_path, layout, step, storage)
        layout.commit(storage, step, {"world_size": 1})
    fake_save(tmp_path, layout, 5, storage)                # in flight: never counted, never removed
    assert layout.retire_old(storage, keep_last=2) == ["step_000000001", "step_000000002"]
    assert committed_steps(layout, storage) == [3, 4]
    assert (tmp_path / "step_000000005.tmp").is_dir()


def test_leftovers_of_an_interrupted_run_are_cleaned(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    fake_save(tmp_path, layout, 7, storage)
    (tmp_path / "step_000000003.deleting").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert sorted(layout.clean_leftovers(storage)) == ["step_000000003.deleting",
                                                       "step_000000007.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_commit_refuses_a_save_without_metadata(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    fake_save(tmp_path, layout, 2, storage)
    (tmp_path / "step_000000002.tmp" / ".metadata").unlink()
    with pytest.raises(RuntimeError, match=".metadata is missing"):
        layout.commit(storage, 2, {"world_size": 1})
    assert committed_steps(layout, storage) == []


def test_commit_refuses_shards_that_rank_0_cannot_see(tmp_path, ckpt):
    """A checkpoint dir on node-local disks: rank 0 sees only its own node's shards."""
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    fake_save(tmp_path, layout, 3, storage)
    (tmp_path / "step_000000003.tmp" / "__0_0.distcp").unlink()
    with pytest.raises(RuntimeError, match="all ranks share"):
        layout.commit(storage, 3, {"world_size": 1})
    assert committed_steps(layout, storage) == []


def test_make_room_clears_an_unfinished_attempt(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    fake_save(tmp_path, layout, 9, storage)             # an attempt that never committed
    layout.make_room(storage, 9)
    assert list((tmp_path / "step_000000009.tmp").iterdir()) == []


def test_commit_file_without_world_size_does_not_count(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    fake_save(tmp_path, layout, 2, storage)
    layout.commit(storage, 2, {"world_size": "two"})
    assert layout.newest_complete_checkpoint(storage) is None
