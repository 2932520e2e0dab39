"""The memory tier's copies: one rank's training state in shared memory of its node.

(A little over 400 lines: a copy's format, its writing and its reading stay in one file,
so that its commit rules read in one place.)

A node's copies live under ``checkpoint.memory_dir`` (default /dev/shm, a tmpfs: RAM),
in a folder of their own per run (``run_folder``): files there outlive the worker that
wrote them, so the workers torchrun restarts in place find them, and vanish with the
node. Each rank's state has two slots on a node, used in turn, so one complete copy
survives while the next is written:

    <memory_dir>/<package>-<hash of checkpoint.dir>/rank-<r>/slot-<0|1>/
        data          every tensor's bytes, back to back (64-byte aligned)
        skeleton.json everything else, each tensor as {MARK: index} (``encode``: plain
                      JSON, tuples and non-string keys tagged; no pickle)
        commit.json   written last, removed first: the slot holds a copy only with it

A copy has the same commit rules as a durable checkpoint: the commit record lists the
sizes and the CRC-32 of every block (``integrity``); a copy cut off while written has
no commit record and is never used. A copy that crossed the network (to the partner, or
back to a replaced node) has every block checked before it is committed; a load checks
as ``checkpoint.verify`` says (all: every block; sample: the skeleton and one data block
in ``SAMPLE_EVERY``; none: the record and the sizes). Writing a copy is the one memory copy of the state the training loop waits for
(``Slot.stage``: straight into the slot's mapped file, whose pages stay allocated from
one save to the next); its checksums and commit record are written by the tier's
thread (``memory_tier``), which also sends the copy to the partner node
(``partners``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import shutil
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ... import PACKAGE
from ..store.integrity import (
    ALGORITHM,
    BLOCK_BYTES,
    ChecksumMismatch,
    mismatch,
    parallel_map,
    sample_blocks,
)

RECORD, DATA, SKELETON = "commit.json", "data", "skeleton.json"
SLOTS = 2          # copies of one rank's state a node holds: the newest complete, the next
ALIGN = 64
MARK = "__tensor__"       # {MARK: i}: the i-th tensor in ``data``
TUPLE, ITEMS = "__tuple__", "__items__"   # a tuple; a dict whose keys are not all strings
FORMAT = 1


class MemoryCopyError(RuntimeError):
    """A memory copy cannot be written or used; the message says which and why."""


def run_folder(memory_dir: str, checkpoint_dir: str) -> Path:
    """This run's folder of copies on this node: one per checkpoint.dir."""
    key = checkpoint_dir if "://" in checkpoint_dir else os.path.abspath(checkpoint_dir)
    return Path(memory_dir) / f"{PACKAGE}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


# ------------------------------------------------------------ the state --
def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The state's ``state_dict()`` trees, made anew, with every tensor replaced by
    {MARK: index}, and the tensors (a DTensor's local shard), in order. The tree shares
    nothing mutable with training, so it can be encoded later, in another thread."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            # A DTensor's shard (its own field: to_local() goes through autograd, ~10 µs
            # a tensor on the training path).
            tensors.append(value._local_tensor if isinstance(value, DTensor) else value)
            return {MARK: len(tensors) - 1}
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return value

    return {key: walk(part.state_dict()) for key, part in state.items()}, tensors


def encode(tree: Any) -> bytes:
    """A flattened tree as JSON: tuples and dicts with keys other than strings tagged,
    so that ``decode`` gives back the same types. Raises MemoryCopyError for a value
    JSON cannot hold (the key named)."""
    def walk(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            if all(isinstance(key, str) for key in value):
                return {key: walk(item, f"{where}.{key}") for key, item in value.items()}
            return {ITEMS: [[walk(key, where), walk(item, f"{where}.{key}")]
                            for key, item in value.items()]}
        if isinstance(value, tuple):
            return {TUPLE: [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]}
        if isinstance(value, list):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise MemoryCopyError(f"{where} is a {type(value).__name__}, which a memory copy "
                              "cannot hold (numbers, strings, lists, tuples, dicts and tensors)")

    return json.dumps({key: walk(value, key) for key, value in tree.items()}).encode()


def decode(data: bytes) -> dict[str, Any]:
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if TUPLE in value and len(value) == 1:
                return tuple(walk(item) for item in value[TUPLE])
            if ITEMS in value and len(value) == 1:
                return {walk(key): walk(item) for key, item in value[ITEMS]}
            if MARK in value and len(value) == 1:
                return value
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value

    return walk(json.loads(data))


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def table_of(tensors: list[torch.Tensor]) -> tuple[list[list[Any]], int]:
    """Where each tensor goes in ``data``: [offset, nbytes, dtype, shape]; the total size."""
    table, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        table.append([offset, nbytes, str(tensor.dtype).removeprefix("torch."),
                      list(tensor.shape)])
        offset += _padded(nbytes)
    return table, offset


def _view(buffer: Any, entry: list[Any]) -> torch.Tensor:
    offset, nbytes, dtype, shape = entry
    dtype = getattr(torch, dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).reshape(shape)


def block_crcs(buffer: Any, size: int, blocks: list[int] | None = None) -> dict[int, str]:
    """The CRC-32 of the blocks of ``buffer`` (all, or those listed), on several threads
    (zlib releases the GIL)."""
    view = memoryview(buffer)[:size]
    chosen = range(-(-size // BLOCK_BYTES)) if blocks is None else blocks
    crcs = parallel_map(
        lambda i: f"{zlib.crc32(view[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]):08x}", chosen)
    return dict(zip(chosen, crcs))


# -------------------------------------------------------------- a slot --
@dataclass
class Copy:
    """A complete copy: whose state (``rank``), of which step, where."""

    rank: int
    step: int
    path: Path
    record: dict[str, Any]


class Slot:
    """One slot of one rank's state on this node (a folder and its mapped data file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._views: tuple[list[list[Any]], list[torch.Tensor]] | None = None

    # -- reading what is there --
    def complete(self) -> Copy | None:
        """The copy here when its commit record is present and the sizes agree."""
        try:
            record = json.loads((self.path / RECORD).read_text())
            sizes = record["sizes"]
            if any((self.path / name).stat().st_size != sizes[name] for name in (DATA, SKELETON)):
                return None
            return Copy(int(record["rank"]), int(record["step"]), self.path, record)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # -- writing a copy --
    def buffer(self, size: int) -> Any:
        """This slot's data file, ``size`` bytes, mapped for writing; the commit record is
        removed first, so the slot holds no copy until ``commit``."""
        self.uncommit()
        self.path.mkdir(parents=True, exist_ok=True)
        if self._map is None or len(self._map) != max(size, 1):
            self.close()
            self._views = None
            fd = os.open(self.path / DATA, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, max(size, 1))
            finally:
                os.close(fd)
        return self._map

    def stage(self, tensors: list[torch.Tensor]) -> list[list[Any]]:
        """Copy the tensors into this slot (the one copy training waits for); the table."""
        table, size = table_of(tensors)
        buffer = self.buffer(size)
        if self._views is None or self._views[0] != table:   # the same layout: same views
            self._views = (table, [_view(buffer, entry) for entry in table])
        with torch.no_grad():
            for target, tensor in zip(self._views[1], tensors):
                if target.numel():
                    target.copy_(tensor)
        return table

    def commit(self, *, rank: int, step: int, table: list[list[Any]], skeleton: bytes,
               extra: dict[str, Any]) -> Copy:
        """Checksums, the skeleton and, last, the commit record (a rename)."""
        size = table_of_size(table)
        (self.path / SKELETON).write_bytes(skeleton)
        record = {"format": FORMAT, "rank": rank, "step": step, "created": time.time(),
                  "table": table, "sizes": {DATA: size, SKELETON: len(skeleton)},
                  "checksum": {"algorithm": ALGORITHM, "block_bytes": BLOCK_BYTES},
                  "crc32": {DATA: list(block_crcs(self._map, size).values()),
                            SKELETON: [f"{zlib.crc32(skeleton):08x}"]}, **extra}
        self.write_record(record)
        return Copy(rank, step, self.path, record)

    def write_record(self, record: dict[str, Any]) -> None:
        temporary = self.path / (RECORD + ".tmp")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, self.path / RECORD)

    def uncommit(self) -> None:
        try:
            (self.path / RECORD).unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def table_of_size(table: list[list[Any]]) -> int:
    """The size of ``data`` for a table (``table_of``'s total)."""
    return table[-1][0] + _padded(table[-1][1]) if table else 0


# ------------------------------------------------------------- loading --
class Opened:
    """A copy opened for loading: its skeleton read and its blocks checked as ``check``
    says (all | sample | none), every check before any byte reaches training. With every
    block checked the file is mapped once (its pages populated in one call), checked
    and copied from the mapping; otherwise each tensor is read straight into its target
    (one copy by the kernel, no mapping). Raises ChecksumMismatch or MemoryCopyError;
    ``close`` when done."""

    def __init__(self, copy: Copy, check: str = "all") -> None:
        self.copy, self.table = copy, copy.record["table"]
        self.size = copy.record["sizes"][DATA]
        self.fd = os.open(copy.path / DATA, os.O_RDONLY)
        self.map: mmap.mmap | None = None
        try:
            if os.fstat(self.fd).st_size != self.size:
                raise MemoryCopyError(f"{copy.path / DATA} is not the {self.size:,} bytes its "
                                      "commit.json records")
            skeleton = (copy.path / SKELETON).read_bytes()
            if check != "none":
                self._check(check, skeleton)
            try:
                self.tree = decode(skeleton)
            except ValueError as exc:
                raise MemoryCopyError(f"{copy.path / SKELETON} cannot be read: {exc}") from None
        except BaseException:
            os.close(self.fd)
            raise

    def _check(self, check: str, skeleton: bytes) -> None:
        record, path = self.copy.record, self.copy.path
        recorded = record["crc32"][DATA]
        if len(recorded) != -(-self.size // BLOCK_BYTES):
            raise ChecksumMismatch(f"{path / DATA}: its commit.json records {len(recorded)} "
                                   f"blocks for {self.size:,} bytes")
        blocks = (list(range(len(recorded))) if check == "all"
                  else sample_blocks(len(recorded), random.Random()))
        if check == "all" and self.size:   # every byte is read twice: map it once
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(self.fd, self.size, flags=flags, prot=mmap.PROT_READ)
        buffers = threading.local()

        def crc_of(index: int) -> str:
            buffer = getattr(buffers, "block", None)
            if buffer is None:
                buffer = buffers.block = bytearray(BLOCK_BYTES)
            view = memoryview(buffer)[:min(BLOCK_BYTES, self.size - index * BLOCK_BYTES)]
            if os.preadv(self.fd, [view], index * BLOCK_BYTES) != len(view):
                raise MemoryCopyError(f"{path / DATA} ended early")
            return f"{zlib.crc32(view):08x}"

        crcs = (block_crcs(self.map, self.size, blocks) if self.map is not None
                else dict(zip(blocks, parallel_map(crc_of, blocks))))
        for index, crc in crcs.items():
            if crc != recorded[index]:
                begin = index * BLOCK_BYTES
                raise ChecksumMismatch(mismatch(f"{path / DATA}", begin,
                                                min(BLOCK_BYTES, self.size - begin),
                                                int(crc, 16), recorded[index]))
        crc, want = f"{zlib.crc32(skeleton):08x}", record["crc32"][SKELETON][0]
        if crc != want:
            raise ChecksumMismatch(mismatch(f"{path / SKELETON}", 0, len(skeleton),
                                            int(crc, 16), want))

    def entry(self, index: int) -> tuple[tuple[int, ...], torch.dtype]:
        _, _, dtype, shape = self.table[index]
        return tuple(shape), getattr(torch, dtype)

    def read_into(self, index: int, target: torch.Tensor) -> None:
        """Tensor ``index`` of the copy into ``target`` (its shape and dtype)."""
        offset, nbytes = self.table[index][0], self.table[index][1]
        if nbytes == 0:
            return
        if self.map is not None:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore", UserWarning)   # a read-only mapping
                target.copy_(_view(self.map, self.table[index]))
            return
        direct = target.device.type == "cpu" and target.is_contiguous()
        buffer = (target.detach().reshape(-1).view(torch.uint8) if direct
                  else torch.empty(nbytes, dtype=torch.uint8))
        if os.preadv(self.fd, [memoryview(buffer.numpy())], offset) != nbytes:
            raise MemoryCopyError(f"{self.copy.path / DATA} ended early")
        if not direct:   # a GPU or strided target: through host memory
            with torch.no_grad():
                target.copy_(buffer.view(target.dtype).reshape(target.shape))

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        os.close(self.fd)


@dataclass
class Fitted:
    """A copy matched to the live state, nothing written yet (``apply`` writes it)."""

    merged: dict[str, Any]
    pairs: list[tuple[torch.Tensor, int]]   # a live tensor, the copy's tensor for it
    opened: Opened


def fit(state: dict[str, Any], opened: Opened) -> Fitted:
    """Match a copy to the live state: every tensor checked against its live counterpart
    (shape and dtype). Raises MemoryCopyError when the copy does not fit."""
    tree = opened.tree
    if set(tree) != set(state):
        raise MemoryCopyError(f"the copy holds {sorted(tree)}, training has {sorted(state)}")
    pairs: list[tuple[torch.Tensor, int]] = []

    def merge(saved: Any, live: Any, where: str) -> Any:
        if isinstance(saved, dict) and set(saved) == {MARK}:
            shape, dtype = opened.entry(saved[MARK])
            target = live.to_local() if isinstance(live, DTensor) else live
            if not isinstance(target, torch.Tensor) or tuple(target.shape) != shape \
                    or target.dtype != dtype:
                got = (f"{tuple(target.shape)} {target.dtype}"
                       if isinstance(target, torch.Tensor) else type(target).__name__)
                raise MemoryCopyError(f"{where} is {shape} {dtype} in the copy and {got} "
                                      "in training")
            pairs.append((target, saved[MARK]))
            return live
        if isinstance(saved, dict):
            live = live if isinstance(live, dict) else {}
            return {key: merge(value, live.get(key), f"{where}.{key}")
                    for key, value in saved.items()}
        if isinstance(saved, (list, tuple)):
            live = live if isinstance(live, (list, tuple)) and len(live) == len(saved) \
                else [None] * len(saved)
            return type(saved)(merge(s, v, f"{where}[{i}]")
                               for i, (s, v) in enumerate(zip(saved, live)))
        return saved

    merged = {key: merge(tree[key], part.state_dict(), key) for key, part in state.items()}
    return Fitted(merged, pairs, opened)


def apply(state: dict[str, Any], fitted: Fitted) -> None:
    """Read a fitted copy into the live tensors, then each part's ``load_state_dict``."""
    for target, index in fitted.pairs:
        fitted.opened.read_into(index, target)
    for key, part in state.items():
        part.load_state_dict(fitted.merged[key])


# -------------------------------------------------------- a node's copies --
def slots_of(folder: Path, rank: int) -> list[Slot]:
    return [Slot(folder / f"rank-{rank}" / f"slot-{i}") for i in range(SLOTS)]


def inventory(folder: Path, world_size: int) -> dict[tuple[int, int], Copy]:
    """The complete copies on this node of this world size: (rank, step) -> copy."""
    found: dict[tuple[int, int], Copy] = {}
    ranks = sorted(int(p.name[5:]) for p in folder.glob("rank-*") if p.name[5:].isdigit())
    for rank in (r for r in ranks if r < world_size):
        for slot in slots_of(folder, rank):
            copy = slot.complete()
            if copy is not None and copy.rank == rank \
                    and copy.record.get("world_size") == world_size:
                found[(rank, copy.step)] = copy
    return found


def newest_copy(folder: Path, rank: int, world_size: int) -> Copy | None:
    """``rank``'s newest complete copy of its own state on this node (None: none)."""
    mine = [copy for (r, _), copy in inventory(folder, world_size).items() if r == rank]
    return max(mine, key=lambda copy: copy.step, default=None)


def free(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
