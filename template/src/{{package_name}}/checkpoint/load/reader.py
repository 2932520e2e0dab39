"""Reading a checkpoint for a load: each file once, front to back, checked as it is read.

Keeps DCP's planning, resharding and file format, but instead of a seek and ``torch.load``
per tensor (a range request each on an object store), a thread per file (``READ_THREADS`` at
once) reads the records a rank needs in file order, up to ``AHEAD_BYTES`` ahead, checking
each block as it completes (``integrity.StreamCheck``); the loading thread deserialises them
from memory (``_Layouts``). Records with DCP's stream transforms (never written here) go to
DCP's own code. docs/PERFORMANCE.md, "Loading and restarting, with the load's own reader".
"""

from __future__ import annotations

import io
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..store.integrity import ChecksumMismatch, Expected, leaf_name
from ..store.storage import LocalStorage, Storage
from .safe_load import SafeFileSystemReader, load_metadata, safe_fsspec_reader_class

READ_THREADS = 4            # files read at once
AHEAD_BYTES = 256 << 20     # how far a file's reading thread may run ahead of the loading
GAP_READ_BYTES = 8 << 20    # unneeded bytes inside a checked block are read in pieces this big


class OneReadMixin:
    """Over a safe reader: ``.metadata`` and ``read_data``, reading each file once;
    ``expected``: commit.json's checksums (None: contents unchecked)."""

    expected: Expected | None = None

    def _parse_metadata(self, path: Any) -> Metadata:
        """``.metadata`` with the restricted unpickler, its checksum checked first; parsed
        once per reader (the load's own ``read_metadata`` reuses the caller's)."""
        if getattr(self, "_metadata", None) is None:
            with self.fs.create_stream(path, "rb") as stream:
                data = stream.read()
            check = self.expected.stream(leaf_name(path), 0) if self.expected else None
            if check is not None:
                if len(data) != check.size:
                    raise ChecksumMismatch(f"{leaf_name(path)} is {len(data):,} bytes, "
                                           f"commit.json recorded {check.size:,}")
                check.update(data)
            self._metadata = load_metadata(data, str(path))
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if info.transform_descriptors:   # DCP extensions: DCP's own reading
                return super().read_data(plan, planner)
            per_file.setdefault(info.relative_path, []).append(item)
        if files := sorted(per_file):
            with ThreadPoolExecutor(min(READ_THREADS, len(files)),
                                    thread_name_prefix="checkpoint-read") as pool:
                pipes, layouts = [_Pipe() for _ in files], _Layouts()
                for name, pipe in zip(files, pipes):
                    pool.submit(self._read_file, name, per_file[name], pipe)
                try:
                    for pipe in pipes:
                        for items, data in pipe:
                            try:
                                _load_record(items, data, planner, layouts)
                            except Exception as exc:  # noqa: BLE001 - re-raised below
                                # Damaged bytes can break the record before their block's
                                # checksum is complete: the checksum's sentence comes first.
                                raise pipe.mismatch_after() or exc from None
                finally:
                    for pipe in pipes:
                        pipe.cancel()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list[ReadItem], pipe: _Pipe) -> None:
        """In a reading thread: the records ``items`` need, in file order, into ``pipe``."""
        records: dict[int, list[ReadItem]] = {}
        for item in items:
            records.setdefault(self.storage_data[item.storage_index].offset, []).append(item)
        order = sorted(records)
        last = self.storage_data[records[order[-1]][0].storage_index]
        begin, end = order[0], last.offset + last.length
        check = None
        if self.expected is not None:
            block = self.expected.block_bytes
            begin -= begin % block
            check = self.expected.stream(name, begin)
            if check is not None:
                end = min(check.size, -(-end // block) * block)
        error: BaseException | None = None
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                stream.seek(begin)
                position = begin
                for offset in order:
                    info = self.storage_data[records[offset][0].storage_index]
                    position = _skip(stream, position, offset, check)
                    data = _read_exactly(stream, info.length, name, offset)
                    if check is not None:
                        check.update(data)
                    position += len(data)
                    if not pipe.put(records[offset], data):
                        return   # the load gave up
                _skip(stream, position, end, check)
        except BaseException as exc:  # noqa: BLE001 - handed to the loading thread
            error = exc
        finally:
            pipe.close(error)


def open_reader(storage: Storage, name: str, expected: Expected | None = None) -> FileSystemReader:
    """The reader for checkpoint ``name``: never DCP's plain one (it unpickles .metadata
    unrestricted); each file read once, in sequence, checking ``expected`` as it reads."""
    kind = OneReadFileSystemReader if isinstance(storage, LocalStorage) else _fsspec_class()
    reader = kind(storage.path(name))
    reader.expected = expected
    return reader


class OneReadFileSystemReader(OneReadMixin, SafeFileSystemReader):
    """DCP's local-filesystem reader: restricted metadata, each file read once and checked."""


@cache
def _fsspec_class() -> type:   # over DCP's fsspec reader; fsspec is optional: built on first use
    return type("OneReadFsspecReader", (OneReadMixin, safe_fsspec_reader_class()), {})


def _load_record(items: list[ReadItem], data: bytearray, planner: LoadPlanner,
                 layouts: _Layouts) -> None:
    """Deserialise one record from memory and copy it where each of ``items`` wants it."""
    tensor = None
    for item in items:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data))
            continue
        if tensor is None:
            tensor = layouts.tensor(data)
        part = tensor   # the piece of the saved chunk this rank's tensor takes
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            if length < tensor.size(dim):
                part = part.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != part.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes "
                                 f"{target.size()} vs {part.size()}")
        target.copy_(part)
        planner.commit_tensor(item, target)


class _Layouts:
    """Tensors out of ``torch.save`` records without a ``torch.load`` each (0.2 ms a record).

    Records of one layout have the same bytes up to their data: the first of each is loaded
    onto the meta device (its layout and ``_checkpoint_offset``), and any record matching it
    up to there is a view of its own data. Anything unexpected goes to ``torch.load``."""

    def __init__(self) -> None:
        self._known: dict[int, list[tuple[bytes, Any]]] = {}   # record length -> layouts

    def tensor(self, data: bytearray) -> torch.Tensor:
        for prefix, layout in self._known.get(len(data), ()):
            if data.startswith(prefix):
                return _view(data, *layout)
        if (layout := self._parse(data)) is None:
            return cast(torch.Tensor, torch.load(io.BytesIO(data), map_location="cpu",
                                                 weights_only=True))
        self._known.setdefault(len(data), []).append((bytes(data[:layout[0]]), layout))
        return _view(data, *layout)

    @staticmethod
    def _parse(data: bytearray) -> tuple | None:
        try:
            meta = torch.load(_BufferFile(data), map_location="meta", weights_only=True)
            storage = meta.untyped_storage()
            layout = (int(storage._checkpoint_offset), storage.nbytes(), meta.dtype,
                      tuple(meta.size()), tuple(meta.stride()), meta.storage_offset())
            _view(data, *layout)
        except Exception:  # noqa: BLE001 - any surprise: torch.load reads the record whole
            return None
        return layout if isinstance(meta, torch.Tensor) and layout[1] > 0 else None


def _view(data: bytearray, offset: int, nbytes: int, dtype: torch.dtype, size: tuple,
          stride: tuple, storage_offset: int) -> torch.Tensor:
    raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).as_strided(size, stride, storage_offset)


class _BufferFile(io.RawIOBase):
    """A read-only file over a buffer, without copying it (``io.BytesIO`` copies)."""

    def __init__(self, data: bytearray) -> None:
        self._data, self._position = memoryview(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._data)}
        self._position = base[whence] + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), len(self._data) - self._position))
        buffer[:count] = self._data[self._position:self._position + count]
        self._position += count
        return count


def _skip(stream: Any, position: int, to: int, check: Any) -> int:
    """Move from ``position`` to ``to``: read the bytes between when they are checked."""
    if to <= position:
        return position
    if check is None:
        stream.seek(to)
        return to
    while position < to:
        data = _read_exactly(stream, min(GAP_READ_BYTES, to - position), "", position)
        check.update(data)
        position += len(data)
    return position


def _read_exactly(stream: Any, length: int, name: str, offset: int) -> bytearray:
    data = bytearray(length)
    view, got = memoryview(data), 0
    while got < length:   # short reads: a network file system, an object store
        if not (more := stream.readinto(view[got:])):
            raise OSError(f"{name or 'a checkpoint file'} ends at byte {offset + got:,}, "
                          f"before the {length:,} bytes from {offset:,} it should hold")
        got += more
    return data


class _Pipe:
    """A file's records from its reading thread to the loading thread, at most AHEAD_BYTES (or
    one record); neither side waits forever (the loading thread cancels in ``finally``)."""

    def __init__(self) -> None:
        self._records: deque[tuple[list[ReadItem], bytearray]] = deque()
        self._held = 0
        self._closed = self._cancelled = False
        self._error: BaseException | None = None
        self._ready = threading.Condition()

    def put(self, items: list[ReadItem], data: bytearray) -> bool:
        with self._ready:
            while self._held and self._held + len(data) > AHEAD_BYTES and not self._cancelled:
                self._ready.wait()
            if self._cancelled:
                return False
            self._records.append((items, data))
            self._held += len(data)
            self._ready.notify_all()
            return True

    def close(self, error: BaseException | None = None) -> None:
        """The reading thread is done; its ``error`` goes to the loading thread first."""
        with self._ready:
            self._closed, self._error = True, error
            self._ready.notify_all()

    def cancel(self) -> None:
        with self._ready:
            self._cancelled = True
            self._records.clear()
            self._ready.notify_all()

    def mismatch_after(self) -> ChecksumMismatch | None:
        """Read the rest of the file (bounded by its size) for a checksum that fails."""
        try:
            deque(self, maxlen=0)   # every record left, each block checked as it completes
        except Exception as exc:  # noqa: BLE001 - other errors: the caller's own is raised
            return exc if isinstance(exc, ChecksumMismatch) else None
        return None

    def __iter__(self) -> Iterator[tuple[list[ReadItem], bytearray]]:
        while True:
            with self._ready:
                while not self._records and not self._closed and self._error is None:
                    self._ready.wait()
                if self._error is not None:
                    raise self._error
                if not self._records:
                    return
                items, data = self._records.popleft()
                self._held -= len(data)
                self._ready.notify_all()
            yield items, data
