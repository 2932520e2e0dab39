"""The memory tier's copies: one rank's training state in shared memory of its node.

A node's copies live under ``checkpoint.memory_dir`` (default /dev/shm: RAM), in a folder
per run (``run_folder``) that outlives the workers torchrun restarts in place. Each rank
has two slots, used in turn, so one complete copy survives while the next is written:
``data`` (every tensor's bytes, 64-byte aligned), ``skeleton.json`` (the rest, each
tensor as {MARK: index}; plain JSON, no pickle) and ``commit.json`` (written last, with
every block's CRC-32: a copy without it is never used). Writing a copy (``Slot.stage``)
is the one memory copy the training loop waits for; loading one is ``reading.py``. The
layout and its rules: docs/RECOVERY.md.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import time
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
    parallel_map,
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


def view(buffer: Any, entry: list[Any]) -> torch.Tensor:
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
            self._views = (table, [view(buffer, entry) for entry in table])
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
