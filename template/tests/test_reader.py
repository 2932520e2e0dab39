"""The load's reader (checkpoint/load/reader.py): the same state as DCP's own reader, on the
same and on another world size; older checkpoints still load; damage found by the load."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from conftest import overrides_for, project_module, torchrun

SMALL = overrides_for("model.d_model=32", "model.n_layers=2", "checkpoint.interval_steps=3",
                      "checkpoint.async_mode=sync", "model.dropout=0.1")


def newest(ckpt_dir: str) -> Path:
    return max(Path(ckpt_dir).glob("step_*"))


def flip_one_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def load_everything(directory: Path, reader) -> dict:
    """Every value of a checkpoint (model, optimizer state, RNG, progress) into one process,
    as DCP reshards them, through ``reader``."""
    metadata = FileSystemReader(directory).read_metadata()
    state = {key: (torch.empty(item.size, dtype=item.properties.dtype)
                   if isinstance(item, TensorStorageMetadata) else None)
             for key, item in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=project_module(
            "checkpoint.load.safe_load").SafeLoadPlanner(), no_dist=True)
    return state


def assert_identical(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    kinds = {"tensor": 0, "rng": 0, "optim": 0}
    for key, a in ours.items():
        b = theirs[key]
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a,
                               b.view(torch.uint8) if b.dtype == torch.bool else b), key
            kinds["tensor"] += 1
        else:
            assert a == b, key
        kinds["rng"] += "rng" in key
        kinds["optim"] += "optim" in key
    assert all(kinds.values()), kinds   # tensors, RNG states and optimizer state compared


def ours(directory: Path, checked: bool = True):
    storage = project_module("checkpoint.store.storage").LocalStorage(directory.parent)
    record = json.loads((directory / "commit.json").read_text())
    expected = project_module("checkpoint.store.integrity").expected(record) if checked else None
    return project_module("checkpoint.load.reader").open_reader(storage, directory.name, expected)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.torch_api), 2])
def test_the_reader_loads_what_dcps_own_reader_loads(run_dirs, nproc):
    """1 -> 1 (the same world size) and 2 -> 1 (DCP reshards): bit for bit the same."""
    torchrun(nproc, "train", *SMALL(run_dirs, "train.max_steps=3"))
    directory = newest(run_dirs["ckpt"])
    assert len(list(directory.glob("*.distcp"))) == nproc
    reference = load_everything(directory, FileSystemReader(directory))
    assert_identical(load_everything(directory, ours(directory)), reference)
    assert_identical(load_everything(directory, ours(directory, checked=False)), reference)


@pytest.mark.torch_api
@pytest.mark.parametrize("where", ["tensor data", "a record's header"])
def test_a_damaged_byte_is_found_by_the_load_itself(tmp_path, ckpt, where):
    """No pass before the load: the candidates are not read, the load finds the damage,
    and names it as damage even when the damaged record cannot even be parsed."""
    layout, storage_mod = ckpt
    integrity = project_module("checkpoint.store.integrity")
    storage = storage_mod.LocalStorage(tmp_path)
    state = {"w": torch.arange(300_000.0), "b": torch.ones(7), "step": 4}
    dcp.save(state, storage_writer=storage.writer(layout.staging_name(4, storage)),
             no_dist=True)
    directory = Path(layout.commit(storage, 4, {"world_size": 1}).path)
    shard = directory / "__0_0.distcp"
    flip_one_byte(shard, shard.stat().st_size // 2 if where == "tensor data" else 1)
    load = project_module("checkpoint.load.restore").load_checkpoint
    (candidate,) = list(layout.sized_newest_first(storage))   # sizes fit: not skipped before the load
    target = {"w": torch.zeros(300_000), "b": torch.zeros(7), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(integrity.ChecksumMismatch, match=r"__0_0\.distcp does not match "
                           r"its checksum: bytes 0-[\d,]+ have crc32"):
            load(storage, target, candidate)
        # checkpoint.verify=none reads the same bytes unchecked: the damage goes through,
        # or breaks the record as something else.
        if where == "tensor data":
            load(storage, target, candidate, verify="none")
            assert not torch.equal(target["w"], state["w"])
        else:
            with pytest.raises(Exception) as failure:   # any error, but not damage
                load(storage, target, candidate, verify="none")
            assert not isinstance(failure.value, integrity.ChecksumMismatch)


@pytest.mark.torch_api
def test_checkpoints_of_earlier_versions_still_load(tmp_path, ckpt, monkeypatch):
    """64 MiB checksum blocks (before this reader; the 12 MB shard is one block, not two) and
    no checksums at all (older still)."""
    layout, storage_mod = ckpt
    integrity = project_module("checkpoint.store.integrity")
    storage = storage_mod.LocalStorage(tmp_path)
    state = {"w": torch.randn(3_000_000), "step": 7}
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 64 << 20)
    dcp.save(state, storage_writer=storage.writer(layout.staging_name(7, storage)),
             no_dist=True)
    layout.commit(storage, 7, {"world_size": 1})
    monkeypatch.undo()
    dcp.save(state, storage_writer=storage.writer(layout.staging_name(8, storage)),
             no_dist=True)
    directory = Path(layout.commit(storage, 8, {"world_size": 1}).path)
    record = json.loads((directory / "commit.json").read_text())
    del record["checksum"]
    record["files"] = {name: entry["size"] for name, entry in record["files"].items()}
    (directory / "commit.json").write_text(json.dumps(record))
    load = project_module("checkpoint.load.restore").load_checkpoint
    old, older = sorted(layout.list_committed(storage), key=lambda c: c.step)
    assert old.record["checksum"]["block_bytes"] == 64 << 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for checkpoint in (old, older):
            target = {"w": torch.zeros(3_000_000), "step": 0}
            load(storage, target, checkpoint)
            assert torch.equal(target["w"], state["w"]) and target["step"] == 7
