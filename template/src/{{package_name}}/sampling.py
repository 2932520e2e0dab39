"""Which samples each rank reads at each step, decided from one global position.

The position in the data is one number, ``samples_consumed``. The samples of step s are
the same set whatever the world size: a seeded permutation per epoch is walked in
global-batch slices, and each rank takes a contiguous share of the slice. That is what
lets a run saved on N ranks continue on M at the exact next sample, for any map-style
dataset the task provides.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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
            f"{worlds_ok}."
        )
    return BatchSplit(global_batch_size, micro_batch_size, world_size,
                      global_batch_size // per_step)


class GlobalBatchSampler:
    """Maps the global data position to the sample indices of a step."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("the dataset has no samples (is the corpus shorter than one "
                             "sequence?)")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, samples_consumed: int) -> torch.Tensor:
        """Indices of the global batch that starts at ``samples_consumed``."""
        out = []
        for pos in range(samples_consumed, samples_consumed + self.global_batch_size):
            epoch, offset = divmod(pos, self.num_samples)
            out.append(self._permutation(epoch)[offset])
        return torch.stack(out)

    def rank_micro_batches(self, samples_consumed: int, rank: int,
                           split: BatchSplit) -> list[torch.Tensor]:
        """This rank's contiguous share of the global batch, cut into micro-batches."""
        share = self.global_batch_size // split.world_size
        mine = self.global_batch(samples_consumed)[rank * share:(rank + 1) * share]
        return list(mine.split(split.micro_batch_size))


class RankMicroBatches:
    """A DataLoader ``batch_sampler``: this rank's micro-batches, step after step.

    It starts at the global position it is given (0, or where a checkpoint left off) and
    never ends; the trainer draws ``grad_accum_steps`` micro-batches per step. A loader
    with workers reads ahead, which changes nothing: the order is fixed by the position.
    """

    def __init__(self, sampler: GlobalBatchSampler, split: BatchSplit, rank: int,
                 start: int) -> None:
        self.sampler = sampler
        self.split = split
        self.rank = rank
        self.start = start

    def __iter__(self) -> Iterator[list[int]]:
        position = self.start
        while True:
            for indices in self.sampler.rank_micro_batches(position, self.rank, self.split):
                yield indices.tolist()
            position += self.split.global_batch_size
