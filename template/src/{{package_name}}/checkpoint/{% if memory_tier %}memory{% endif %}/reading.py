"""Loading a memory copy: opened with its blocks checked as ``checkpoint.verify`` says
(before any byte reaches training), matched to the live state, then read into it."""

from __future__ import annotations

import mmap
import os
import random
import threading
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..store.integrity import BLOCK_BYTES, ChecksumMismatch, mismatch, parallel_map, sample_blocks
from .copies import DATA, MARK, SKELETON, Copy, MemoryCopyError, block_crcs, decode, view


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
                target.copy_(view(self.map, self.table[index]))
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
