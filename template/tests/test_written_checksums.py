"""Checksums computed as the bytes are written (checkpoint/store/checksummed_writer.py):
they equal a read of the files, a writer whose bytes differ from them is caught, and the
commit reads the writers' record and no shard."""

from __future__ import annotations

import json
import logging
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import project_module

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api

STATE = {"w": torch.arange(3000.0), "b": torch.ones(7), "step": 4, "name": "run"}


def block_crcs(data: bytes, block: int) -> list[str]:
    return [f"{zlib.crc32(data[i:i + block]):08x}"
            for i in range(0, max(len(data), 1), block)]


def save(storage, layout, step: int, writer=None) -> str:
    """A real one-process DCP save of STATE into the staging directory of ``step``."""
    work = layout.staging_name(step, storage)
    dcp.save(STATE, storage_writer=writer or storage.writer(work), no_dist=True)
    return work


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path, ckpt):
    _, storage_mod = ckpt
    if request.param == "local":
        yield storage_mod.LocalStorage(tmp_path)
        return
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://written-{request.node.name.replace('[', '-').rstrip(']')}"  # no glob
    yield storage_mod.FsspecStorage(url)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_the_recorded_checksums_equal_a_read_of_the_files(storage, ckpt, monkeypatch):
    layout, _ = ckpt
    integrity = project_module("checkpoint.store.integrity")
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1000)   # several blocks, one partial
    work = save(storage, layout, 3)
    files = storage.list_files(work)
    with storage.open_read(f"{work}/{integrity.RECORD_FILE}") as handle:
        record = json.loads(handle.read())
    assert record["block_bytes"] == 1000
    assert sorted(record["files"]) == sorted(set(files) - {integrity.RECORD_FILE})
    for name, entry in record["files"].items():
        with storage.open_read(f"{work}/{name}") as handle:
            data = handle.read()
        assert entry == {"size": len(data), "crc32": block_crcs(data, 1000)}, name
    assert len(record["files"]["__0_0.distcp"]["crc32"]) > 10
    committed = layout.commit(storage, 3, {"world_size": 1})
    assert committed.record["checksum"] == {"algorithm": "crc32", "block_bytes": 1000}
    assert sorted(storage.list_files(committed.name)) == sorted([*record["files"], "commit.json"])
    for name, entry in committed.record["files"].items():
        with storage.open_read(f"{committed.name}/{name}") as handle:
            data = handle.read()
        assert entry == {"size": len(data), "crc32": block_crcs(data, 1000)}, name
    assert layout.newest_complete_checkpoint(storage).step == 3


@contextmanager
def reads_counted(storage):
    """The names ``storage.open_read`` opens meanwhile."""
    opened, real = [], storage.open_read

    def counting(name):
        opened.append(name.rsplit("/", 1)[-1])
        return real(name)

    storage.open_read = counting
    try:
        yield opened
    finally:
        storage.open_read = real


def test_the_commit_reads_the_record_and_no_shard(storage, ckpt):
    layout, _ = ckpt
    integrity = project_module("checkpoint.store.integrity")
    save(storage, layout, 5)
    with reads_counted(storage) as opened:
        layout.commit(storage, 5, {"world_size": 1})
    assert opened == [integrity.RECORD_FILE]


class _DropsAByte:
    """A raw stream that loses the first byte of its first large write, and says it
    wrote them all."""

    def __init__(self, raw) -> None:
        self.raw, self.dropped = raw, False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if not self.dropped and len(view) > 1000:
            self.dropped = True
            self.raw.write(view[1:])
            return len(view)
        return self.raw.write(view)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _local_fs_class():
    from torch.distributed.checkpoint.filesystem import FileSystem

    checksummed = project_module("checkpoint.store.checksummed_writer")

    class Dropping(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as raw:
                yield _DropsAByte(raw) if str(path).endswith(".distcp") else raw

    class ChecksummingOverDropping(checksummed.ChecksummingFileSystem, Dropping):
        pass

    return checksummed, ChecksummingOverDropping


def test_a_stream_that_drops_a_byte_is_not_committed(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    checksummed, faulty_fs = _local_fs_class()
    writer = checksummed.LocalWriter(storage.path(layout.staging_name(6, storage)))
    writer.fs = faulty_fs()
    save(storage, layout, 6, writer)
    assert writer.fs.take() == {}
    with pytest.raises(RuntimeError, match=r"__0_0\.distcp is [\d,]+ bytes on storage, \d+ were "
                                           r"written"):
        layout.commit(storage, 6, {"world_size": 1})
    assert layout.newest_complete_checkpoint(storage) is None


def test_a_wrong_recorded_checksum_is_found_by_the_load_and_by_verify(tmp_path, ckpt, caplog):
    layout, storage_mod = ckpt
    checksummed = project_module("checkpoint.store.checksummed_writer")
    storage = storage_mod.LocalStorage(tmp_path)
    save(storage, layout, 7)
    layout.commit(storage, 7, {"world_size": 1})

    class MisrecordingFS(type(storage.writer("x").fs)):
        def take(self):
            taken = super().take()
            if "__0_0.distcp" in taken:
                crcs = taken["__0_0.distcp"]["crc32"]
                crcs[0] = f"{int(crcs[0], 16) ^ 1:08x}"
            return taken

    writer = checksummed.LocalWriter(storage.path(layout.staging_name(8, storage)))
    writer.fs = MisrecordingFS()
    save(storage, layout, 8, writer)
    directory = Path(layout.commit(storage, 8, {"world_size": 1}).path)   # it trusts the record
    message = r"__0_0\.distcp does not match its checksum: bytes 0-[\d,]+ have crc32 [0-9a-f]{8}"
    with caplog.at_level(logging.WARNING):
        assert layout.newest_complete_checkpoint(storage, verify="all").step == 7
    assert f"skipping checkpoint {directory}: __0_0.distcp does not match" in caplog.text
    load = project_module("checkpoint.load.restore").load_checkpoint
    candidate = next(c for c in layout.sized_newest_first(storage) if c.step == 8)
    state = {"w": torch.zeros(3000), "b": torch.zeros(7), "step": 0, "name": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(project_module("checkpoint.store.integrity").ChecksumMismatch,
                           match=message):
            load(storage, state, candidate)


def test_a_save_written_without_checksums_is_not_committed(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    work = layout.staging_name(9, storage)
    dcp.save(STATE, storage_writer=dcp.FileSystemWriter(storage.path(work)), no_dist=True)
    with pytest.raises(RuntimeError, match=r"\.checksums\.json is missing"):
        layout.commit(storage, 9, {"world_size": 1})
