"""Partner ranks of the memory tier, and sending a memory copy from one rank to another.

Each rank's copy also goes to a partner rank on the next node (nodes ordered by their
lowest rank; the partner is the rank with the same index there), so no pair shares a
node and a lost node's copies survive on the node after it. A node is told apart by
its host name and its ``checkpoint.memory_dir``: the ranks that see the same folder of
copies are on one node. With one node there is no partner.

A copy travels as its three files (commit record, skeleton, data) over gloo,
point-to-point, straight from the sender's mapped slot into the receiver's; the
receiver checks every block against the sender's commit record before it commits.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .copies import DATA, SKELETON, Copy, Slot, table_of_size
from .reading import Opened

HEADER = 4   # has a copy, step, commit-record bytes, skeleton bytes


def node_identity(memory_dir: str) -> str:
    return f"{socket.gethostname()}:{os.path.realpath(memory_dir)}"


@dataclass(frozen=True)
class Partners:
    """Who sends to whom: ``partner[r]`` holds rank r's copies on another node (None:
    one node only); ``node[r]`` is the index of r's node."""

    node: tuple[int, ...]
    partner: tuple[int | None, ...]

    @classmethod
    def of(cls, identities: list[str]) -> Partners:
        order: list[str] = []
        for identity in identities:   # nodes by their lowest rank
            if identity not in order:
                order.append(identity)
        members = {identity: [r for r, i in enumerate(identities) if i == identity]
                   for identity in order}
        node = tuple(order.index(identity) for identity in identities)
        partner: list[int | None] = []
        for rank, identity in enumerate(identities):
            if len(order) == 1:
                partner.append(None)
                continue
            index = members[identity].index(rank)
            after = members[order[(order.index(identity) + 1) % len(order)]]
            partner.append(after[index % len(after)])
        return cls(node, tuple(partner))

    @property
    def nodes(self) -> int:
        return len(set(self.node))

    def sources(self, rank: int) -> list[int]:
        """The ranks whose copies ``rank`` holds."""
        return [q for q, p in enumerate(self.partner) if p == rank]


def gather_identities(memory_dir: str, group=None) -> list[str]:
    mine = node_identity(memory_dir)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    identities: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, mine, group=group)
    return [str(i) for i in identities]


# ------------------------------------------------------------- transfer --
def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _map_tensor(buffer, size: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # a read-only map
        return torch.frombuffer(buffer, dtype=torch.uint8, count=size)


class Sending:
    """A copy on its way out to rank ``to`` (None: a header saying there is none)."""

    def __init__(self, copy: Copy | None, to: int, group=None) -> None:
        if copy is None:
            self.works = [dist.isend(torch.zeros(HEADER, dtype=torch.int64), to, group=group)]
            return
        record = json.dumps(copy.record).encode()
        skeleton = (copy.path / SKELETON).read_bytes()
        size = copy.record["sizes"][DATA]
        with open(copy.path / DATA, "rb") as handle:
            self.data = mmap.mmap(handle.fileno(), max(size, 1), access=mmap.ACCESS_READ)
        header = torch.tensor([1, copy.step, len(record), len(skeleton)], dtype=torch.int64)
        self.works = [dist.isend(header, to, group=group),
                      dist.isend(_bytes_tensor(record + skeleton), to, group=group)]
        if size:
            self.works.append(dist.isend(_map_tensor(self.data, size), to, group=group))

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class Receipt:
    """A copy on its way in from rank ``source`` into ``slot`` (``finish`` commits it)."""

    def __init__(self, source: int, slot: Slot, group=None) -> None:
        self.source, self.slot, self.group = source, slot, group
        self.header = torch.zeros(HEADER, dtype=torch.int64)
        self.work = dist.irecv(self.header, source, group=group)

    def finish(self) -> Copy | None:
        """Receive the rest (after the header arrived) and commit it; None when the
        sender had no copy. Raises ChecksumMismatch when the bytes differ from the
        sender's commit record (the slot is then left without a copy)."""
        self.work.wait()
        has, step, record_len, skeleton_len = (int(v) for v in self.header.tolist())
        if not has:
            return None
        small = torch.empty(record_len + skeleton_len, dtype=torch.uint8)
        dist.recv(small, self.source, group=self.group)
        raw = small.numpy().tobytes()
        record = json.loads(raw[:record_len])
        skeleton = raw[record_len:]
        size = table_of_size(record["table"])
        buffer = self.slot.buffer(size)
        if size:
            dist.recv(_map_tensor(buffer, size), self.source, group=self.group)
        (self.slot.path / SKELETON).write_bytes(skeleton)
        copy = Copy(int(record["rank"]), int(step), self.slot.path, record)
        Opened(copy).close()   # every block against the sender's record, before it counts
        self.slot.write_record(record)
        return copy
