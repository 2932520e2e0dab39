"""Checksums of a checkpoint's files: recorded as they are written, checked before a load.

A size says a file was written whole; only a checksum says its bytes are the ones written.
``commit.json`` records each file's size and the CRC-32 of each 8 MiB block, computed as
the bytes go out (``BlockCrcs``, ``checksummed_writer.py``) into ``RECORD_FILE``, which the
commit reads instead of any shard. A commit.json without checksums (``files`` maps names to
sizes) is accepted with sizes only, and said so. Format, modes (``checkpoint.verify``), the
load's check (``StreamCheck``), why CRC-32: docs/RESUMING.md, "Damaged bytes: checksums";
docs/PERFORMANCE.md, "Saves: checksums as the bytes are written, nothing read back".
"""

from __future__ import annotations

import json
import math
import os
import random
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .storage import Storage

ALGORITHM = "crc32"
# 8 MiB: a load checks whole blocks, so a rank that needs a few small records of another
# rank's file reads at most a block around each; commit.json holds 128 values per GiB.
BLOCK_BYTES = 8 << 20
SAMPLE_EVERY = 8
MAX_THREADS = 8      # files checksummed at once (commit and verification)
_READ_BYTES = 1 << 20
MODES = ("all", "sample", "none")
RECORD_FILE = ".checksums.json"   # beside a save's shards: each file's checksums, as written


def leaf_name(path: Any) -> str:
    """A file's name in the checkpoint directory (DCP writes no subdirectories)."""
    return str(path).replace("\\", "/").rsplit("/", 1)[-1]


class BlockCrcs:
    """The CRC-32 of each ``block_bytes`` of a stream, as its bytes go by: ``entry()`` is
    what commit.json records for the file (an empty file has one block, 00000000)."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block, self.size, self.blocks, self._crc = block_bytes, 0, [], 0

    def update(self, view: memoryview) -> None:
        if len(view) < self.block - self.size % self.block:   # most writes: inside a block
            self._crc = zlib.crc32(view, self._crc)
            self.size += len(view)
            return
        while view:
            take = min(len(view), self.block - self.size % self.block)
            self._crc = zlib.crc32(view[:take], self._crc)
            self.size += take
            view = view[take:]
            if self.size % self.block == 0:
                self.blocks.append(f"{self._crc:08x}")
                self._crc = 0

    def entry(self) -> dict[str, Any]:
        tail = [f"{self._crc:08x}"] if self.size % self.block or not self.size else []
        return {"size": self.size, ALGORITHM: [*self.blocks, *tail]}


def recorded_entries(storage: Storage, work: str, files: dict[str, int]) -> tuple[dict, int]:
    """commit.json's ``files`` and the block size for the save in ``work`` (``files``: its
    files and sizes on storage), from RECORD_FILE alone; RuntimeError naming a file that is
    not visible, has another size than written, or was not written by a checksumming writer."""
    where = f"cannot commit {storage.path(work)}"
    try:
        with storage.open_read(f"{work}/{RECORD_FILE}") as handle:
            record = json.loads(handle.read())
        block, entries = int(record["block_bytes"]), dict(record["files"])
    except FileNotFoundError:
        raise RuntimeError(f"{where}: {RECORD_FILE} is missing (its writers recorded no "
                           "checksums)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"{where}: {RECORD_FILE} is unreadable ({exc})") from None
    if missing := sorted(entries.keys() - files.keys()):
        raise RuntimeError(f"{where}: {', '.join(missing)} not visible to rank 0; "
                           "checkpoint.dir must be storage that all ranks share")
    listed = {}
    for name, size in sorted(files.items()):
        if name == RECORD_FILE:
            continue
        if name not in entries:
            raise RuntimeError(f"{where}: {name} has no recorded checksum (it was not "
                               "written by the checkpoint's writers)")
        if entries[name].get("size") != size:
            raise RuntimeError(f"{where}: {name} is {size:,} bytes on storage, "
                               f"{entries[name].get('size')} were written")
        listed[name] = entries[name]
    return listed, block


def file_sizes(record: dict[str, Any]) -> dict[str, int] | None:
    """Each listed file's size (both commit.json formats), or None if ``files`` is malformed."""
    files = record.get("files")
    if not isinstance(files, dict):
        return None
    sizes = {name: e.get("size") if isinstance(e, dict) else e for name, e in files.items()}
    valid = all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes.values())
    return sizes if valid else None


class ChecksumMismatch(OSError):
    """A file's bytes differ from the checksums its commit.json recorded."""


def mismatch(file_name: str, begin: int, length: int, crc: int, recorded: str) -> str:
    """The sentence for a block whose checksum differs (the one wording everywhere)."""
    return (f"{file_name} does not match its checksum: bytes {begin:,}-{begin + length:,} "
            f"have {ALGORITHM} {crc:08x}, commit.json recorded {recorded} (changed after it "
            "was committed)")


@dataclass(frozen=True)
class Expected:
    """A commit.json's checksums: each file's CRC-32 per ``block_bytes`` block, and size."""

    block_bytes: int
    crcs: dict[str, list[str]]
    sizes: dict[str, int]

    def stream(self, file_name: str, start: int) -> StreamCheck | None:
        """A check of ``file_name`` read from ``start`` (a block boundary); None if unlisted."""
        return (StreamCheck(file_name, self.crcs[file_name], self.block_bytes, start,
                            self.sizes[file_name]) if file_name in self.crcs else None)


def expected(record: dict[str, Any]) -> Expected | None:
    """The checksums of a commit.json, or None when it has none (an older version wrote it)."""
    files = record.get("files")
    scheme = record.get("checksum")
    if not (isinstance(files, dict) and isinstance(scheme, dict)
            and scheme.get("algorithm") == ALGORITHM
            and isinstance(scheme.get("block_bytes"), int) and scheme["block_bytes"] > 0
            and all(isinstance(e, dict) and isinstance(e.get(ALGORITHM), list)
                    and isinstance(e.get("size"), int) for e in files.values())):
        return None
    return Expected(scheme["block_bytes"], {n: e[ALGORITHM] for n, e in files.items()},
                    {n: e["size"] for n, e in files.items()})


class StreamCheck:
    """The CRC-32 of a file's blocks as its bytes go by, in order, from ``start`` (a block
    boundary): ``update`` raises ChecksumMismatch once a block ends (or the file does) and
    differs. Bytes before ``start`` and after the last byte given are not checked."""

    def __init__(self, file_name: str, recorded: list[str], block: int, start: int,
                 size: int) -> None:
        if start % block:
            raise ValueError(f"a checked read starts at a block boundary, not at {start}")
        self.file_name, self.recorded, self.block, self.size = file_name, recorded, block, size
        self.position, self.crc = start, 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            index = self.position // self.block
            end = min((index + 1) * self.block, self.size)
            take = min(len(view), end - self.position)
            if take <= 0:
                raise ChecksumMismatch(f"{self.file_name} is longer than the {self.size:,} "
                                       "bytes commit.json recorded")
            self.crc = zlib.crc32(view[:take], self.crc)
            self.position += take
            view = view[take:]
            if self.position == end:
                begin = index * self.block
                if index >= len(self.recorded) or f"{self.crc:08x}" != self.recorded[index]:
                    raise ChecksumMismatch(mismatch(
                        self.file_name, begin, end - begin, self.crc,
                        self.recorded[index] if index < len(self.recorded) else "nothing"))
                self.crc = 0


@dataclass
class Check:
    """The outcome of checking one checkpoint's contents against its commit.json."""

    files: int = 0
    bytes: int = 0            # total size of the listed files
    checked_bytes: int = 0    # bytes read and checksummed
    problem: str = ""         # empty when nothing is wrong
    unverified: bool = False  # commit.json has no checksums (an older version wrote it)


def check_contents(storage: Storage, name: str, record: dict[str, Any], mode: Any = "all",
                   rng: random.Random | None = None) -> Check:
    """Compare checkpoint ``name``'s files with its ``record``'s checksums (sizes are checked
    already, by discovery); the Check's ``problem`` names the first that differs, and where."""
    value = getattr(mode, "value", mode)
    if value not in MODES:
        raise ValueError(f"verification mode must be one of {', '.join(MODES)}, got {mode!r}")
    sizes = file_sizes(record) or {}
    scheme = expected(record)
    check = Check(files=len(sizes), bytes=sum(sizes.values()), unverified=scheme is None)
    if scheme is None or value == "none":
        return check
    block = scheme.block_bytes
    rng = rng or random.Random()
    plan = []
    for file_name in sorted(scheme.crcs):
        size, recorded = scheme.sizes[file_name], scheme.crcs[file_name]
        count = max(1, math.ceil(size / block))
        if len(recorded) != count:
            check.problem = (f"{file_name}: commit.json lists {len(recorded)} checksum blocks "
                             f"for {size} bytes, expected {count}")
            return check
        chosen = list(range(count)) if value == "all" else sample_blocks(count, rng)
        plan.append((file_name, size, recorded, chosen))

    def one_file(item: tuple[str, int, list[str], list[int]]) -> tuple[int, str]:
        file_name, size, recorded, chosen = item
        checked = 0
        try:
            with storage.open_read(f"{name}/{file_name}") as handle:
                for index in chosen:
                    handle.seek(index * block)
                    crc, got = _crc_of_block(handle, block)
                    checked += got
                    expected = min(block, size - index * block)
                    if got != expected or f"{crc:08x}" != recorded[index]:
                        return checked, mismatch(file_name, index * block, expected, crc,
                                                 recorded[index])
        except OSError as exc:
            return checked, f"{file_name} cannot be read: {exc}"
        return checked, ""

    for checked, problem in parallel_map(one_file, plan):
        check.checked_bytes += checked
        check.problem = check.problem or problem   # the first file (by name) that fails
    return check


def parallel_map(function: Any, items: list[Any]) -> list[Any]:
    """``map`` over files on up to MAX_THREADS threads, results in order (zlib.crc32 and
    file reads release the GIL: a multi-rank checkpoint's files are checksummed side by side)."""
    workers = min(MAX_THREADS, len(items), os.cpu_count() or 1)
    if workers <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checksum") as pool:
        return list(pool.map(function, items))


def sample_blocks(count: int, rng: random.Random) -> list[int]:
    """The blocks a sampled check reads: the first, the last, one in SAMPLE_EVERY between."""
    if count <= 2:
        return list(range(count))
    middle = range(1, count - 1)
    picked = rng.sample(middle, max(1, math.ceil(len(middle) / SAMPLE_EVERY)))
    return [0, *sorted(picked), count - 1]


def _crc_of_block(handle: Any, block: int) -> tuple[int, int]:
    """CRC-32 of the next ``block`` bytes (fewer at the end) and how many were read."""
    crc, got = 0, 0
    while got < block:
        if not (chunk := handle.read(min(_READ_BYTES, block - got))):
            break
        crc = zlib.crc32(chunk, crc)
        got += len(chunk)
    return crc, got
