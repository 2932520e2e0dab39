"""Training data whose order does not depend on the number of ranks.

The position in the data is one global number, ``samples_consumed``. The samples of
step s are the same set whatever the world size: a seeded permutation per epoch is
walked in global-batch slices, and each rank takes a contiguous share of the slice.
That is what lets a run saved on N ranks continue on M at the exact next sample.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

_WORDS = (
    "the", "a", "one", "every", "some", "model", "rank", "shard", "node", "signal", "step",
    "batch", "save", "plan", "loss", "grad", "cloud", "spot", "job", "disk", "queue", "worker",
    "stream", "token", "layer", "clock", "night", "morning", "river", "stone", "quiet",
    "bright", "slow", "fast", "early", "late", "small", "large", "keeps", "writes", "reads",
    "stops", "starts", "waits", "resumes", "trains", "moves", "learns", "counts", "holds",
    "finds", "loses", "returns", "carries", "under", "over", "after", "before", "with",
    "without", "into", "from",
)


def generate_corpus(n_chars: int, seed: int = 0) -> str:
    """Deterministic pseudo-English with enough structure for a loss curve to fall."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 11))]
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"]) + " "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_chars]


def load_tokens(corpus: str, n_chars: int) -> torch.Tensor:
    """Byte tokens of the corpus file, or of the generated corpus when none is given."""
    text = Path(corpus).read_text(encoding="utf-8") if corpus else generate_corpus(n_chars)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class BatchSizeError(ValueError):
    """The global batch cannot be split evenly over this many ranks."""


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    world_size: int
    grad_accum_steps: int


def plan_batches(global_batch_size: int, micro_batch_size: int, world_size: int) -> BatchPlan:
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
    return BatchPlan(global_batch_size, micro_batch_size, world_size, global_batch_size // per_step)


class GlobalBatchSampler:
    """Maps the global data position to the sample indices of a step."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("the corpus is shorter than one sequence; use a larger corpus")
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

    def rank_micro_batches(self, samples_consumed: int, rank: int, plan: BatchPlan) -> list[torch.Tensor]:
        """This rank's contiguous share of the global batch, cut into micro-batches."""
        share = self.global_batch_size // plan.world_size
        mine = self.global_batch(samples_consumed)[rank * share:(rank + 1) * share]
        return list(mine.split(plan.micro_batch_size))


class TokenDataset:
    """Fixed-length windows of the token stream; sample i starts at i * seq_len."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = indices * self.seq_len
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets[None, :]]
        return windows[:, :-1], windows[:, 1:]
