"""Which samples each rank reads at each step, decided from one global position.

A seeded permutation per epoch, computed index by index and never stored, is walked in
global-batch slices from ``samples_consumed``; each rank takes a contiguous share. A step's
samples are thus the same on any world size: a run saved on N ranks continues on M at the
exact next sample.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


class BatchSizeError(ValueError):
    """The global batch cannot be split evenly over this many ranks."""


@dataclass(frozen=True)
class BatchSplit:
    """How the global batch is cut: per rank, per micro-batch, and accumulated."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    grad_accum_steps: int


def split_global_batch(global_batch_size: int, micro_batch_size: int,
                       world_size: int) -> BatchSplit:
    """Gradient accumulation that keeps the global batch fixed on this world size."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        micro_ok = [m for m in range(1, global_batch_size + 1)
                    if global_batch_size % (m * world_size) == 0]
        worlds_ok = [w for w in range(1, global_batch_size // micro_batch_size + 1)
                     if global_batch_size % (micro_batch_size * w) == 0]
        hint = (f"with {world_size} ranks use train.micro_batch_size in {micro_ok}"
                if micro_ok else f"no micro-batch size fits {world_size} ranks")
        raise BatchSizeError(
            f"train.global_batch_size={global_batch_size} cannot be split over "
            f"{world_size} ranks x train.micro_batch_size={micro_batch_size}: "
            f"{hint}; with micro_batch_size={micro_batch_size} the world size must be one of "
            f"{worlds_ok}.")
    return BatchSplit(global_batch_size, micro_batch_size, world_size,
                      global_batch_size // per_step)


_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash (uint64 wraps around)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A seeded pseudo-random permutation of ``range(n)``, evaluated at given positions.

    A balanced Feistel network over the smallest even bit width holding n; positions sent
    past n go through it again until inside ("cycle walking")."""

    ROUNDS = 6

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.low = np.uint64((1 << int(self.half)) - 1)
        key = _mix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
        self.keys = _mix64(key + np.arange(1, self.ROUNDS + 1, dtype=np.uint64))

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.low
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.low)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._rounds(np.asarray(positions, dtype=np.uint64))
        while (outside := out >= self.n).any():
            out[outside] = self._rounds(out[outside])
        return out.astype(np.int64)


class GlobalBatchSampler:
    """Maps the global data position to the sample indices of a step."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("the dataset has no samples (is the corpus shorter than one "
                             "sequence?)")
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed

    def permutation(self, epoch: int) -> Permutation:
        """The order of the samples in ``epoch``: another permutation for every epoch."""
        return Permutation(self.num_samples, self.seed * 1_000_003 + epoch)

    def global_batch(self, samples_consumed: int) -> torch.Tensor:
        """Indices of the global batch that starts at ``samples_consumed``."""
        positions = np.arange(samples_consumed, samples_consumed + self.global_batch_size,
                              dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self.permutation(int(epoch))(offsets[here])
        return torch.from_numpy(out)

    def rank_micro_batches(self, samples_consumed: int, rank: int,
                           split: BatchSplit) -> list[torch.Tensor]:
        """This rank's contiguous share of the global batch, cut into micro-batches."""
        share = self.global_batch_size // split.world_size
        mine = self.global_batch(samples_consumed)[rank * share:(rank + 1) * share]
        return list(mine.split(split.micro_batch_size))


class RankMicroBatches:
    """A DataLoader ``batch_sampler``: this rank's micro-batches from global position
    ``start`` on, without end (reading ahead changes nothing: the position fixes the order)."""

    def __init__(self, sampler: GlobalBatchSampler, split: BatchSplit, rank: int,
                 start: int) -> None:
        self.sampler, self.split, self.rank, self.start = sampler, split, rank, start

    def __iter__(self) -> Iterator[list[int]]:
        for position in itertools.count(self.start, self.split.global_batch_size):
            for indices in self.sampler.rank_micro_batches(position, self.rank, self.split):
                yield indices.tolist()
