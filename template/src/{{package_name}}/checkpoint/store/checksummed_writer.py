"""DCP writers that checksum every file as its bytes are written: nothing is read back.

Each rank's writer computes ``integrity``'s per-block CRC-32 on the way out; the values
reach the coordinator with the write results, and its writer records them all in
``integrity.RECORD_FILE`` for the commit. Shards and ``.metadata`` stay DCP's own (any DCP
reader reads them). docs/PERFORMANCE.md, "Saves: checksums as the bytes are written".
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from . import integrity

_CARRIER = "__checksums_of_rank__"   # the fqn of the write result that carries them


class _CrcStream:
    """A write stream that checksums the bytes it passes on. ``tell``, ``flush`` and
    ``fileno`` are the stream's own, so that DCP still records item offsets and fsyncs
    the file; there is no ``seek``: a write that went back would void the checksums."""

    def __init__(self, raw: Any, block_bytes: int) -> None:
        self._raw, self.crcs = raw, integrity.BlockCrcs(block_bytes)

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.crcs.update(view if written is None else view[:written])
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        self._raw.flush()   # what fsync is asked to make durable must have left the buffer
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def close(self) -> None:
        self._raw.close()


class ChecksummingFileSystem:
    """Mixed into a DCP ``FileSystem``: every file opened with ``wb`` is checksummed as it
    is written; ``take`` hands over the entries of the files written whole since the last
    call. Picklable: the writer goes to the checkpoint process."""

    block_bytes = integrity.BLOCK_BYTES

    def _written(self) -> tuple[threading.Lock, dict[str, dict[str, Any]]]:
        if "_lock" not in self.__dict__:
            self._lock, self._entries = threading.Lock(), {}
        return self._lock, self._entries

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_entries")}

    @contextmanager
    def create_stream(self, path: Any, mode: str):
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _CrcStream(raw, self.block_bytes)
            yield stream
            lock, entries = self._written()   # only a file written to the end counts
            with lock:
                entries[integrity.leaf_name(path)] = stream.crcs.entry()

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        lock, entries = self._written()
        with lock:
            if integrity.leaf_name(path) in entries:
                entries[integrity.leaf_name(new_path)] = entries.pop(integrity.leaf_name(path))

    def take(self) -> dict[str, dict[str, Any]]:
        lock, entries = self._written()
        with lock:
            taken = dict(entries)
            entries.clear()
        return taken


@contextmanager
def _zip_crc32_off():
    """torch.save's own CRC-32 of each zip record off while DCP writes: torch.load does not
    check it, the block checksums cover the same bytes, and it cost as much CPU as they do."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    put = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or put is None:
        yield
        return
    before = get()
    put(False)
    try:
        yield
    finally:
        put(before)


class _LocalFileSystem(ChecksummingFileSystem, FileSystem):
    """DCP's local FileSystem, checksumming."""


@dataclass(frozen=True)
class _Carried:
    """One rank's checksums among its write results; ``finish`` takes them out for DCP."""

    entries: dict[str, dict[str, Any]]


class ChecksummingWriterMixin:
    """``write_data`` adds this rank's checksums to its results; ``finish`` (the
    coordinator) writes DCP's metadata, then records every file's checksums."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _zip_crc32_off():
            written = super().write_data(plan, planner)

        def with_checksums(done: Any) -> list[WriteResult]:
            carrier = WriteResult(index=MetadataIndex(_CARRIER), size_in_bytes=0,
                                  storage_data=_Carried(self.fs.take()))
            return [*done.value(), carrier]

        return written.then(with_checksums)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        carried = [r.storage_data for rank in results for r in rank
                   if isinstance(r.storage_data, _Carried)]
        super().finish(metadata, [[r for r in rank if not isinstance(r.storage_data, _Carried)]
                                  for rank in results])
        entries = {name: entry for c in carried for name, entry in c.entries.items()}
        entries.update(self.fs.take())   # .metadata, written and renamed just now
        data = json.dumps({"algorithm": integrity.ALGORITHM,
                           "block_bytes": self.fs.block_bytes,
                           "files": dict(sorted(entries.items()))}).encode()
        # Not synced: the commit reads it into commit.json; a crash before leaves no commit.
        with self.fs.create_stream(self.fs.concat_path(self.path, integrity.RECORD_FILE),
                                   "wb") as stream:
            stream.write(data)
        self.fs.take()


class LocalWriter(ChecksummingWriterMixin, FileSystemWriter):
    """DCP's FileSystemWriter, every file checksummed as it is written."""

    def __init__(self, path: Any, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _LocalFileSystem()
        self.fs.block_bytes = integrity.BLOCK_BYTES   # the value here, not the process's
