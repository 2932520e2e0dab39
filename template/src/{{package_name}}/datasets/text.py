"""Byte-level windows of a text: the default task's data (``TextConfig``: ``data:``).

Sample i is the ``seq_len + 1`` bytes from ``i * seq_len``: inputs its first ``seq_len``
bytes, targets its last ``seq_len``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..config import ConfigError, require

_WORDS = (
    "the", "a", "one", "every", "some", "model", "rank", "shard", "node", "signal", "step",
    "batch", "save", "plan", "loss", "grad", "cloud", "spot", "job", "disk", "queue", "worker",
    "stream", "token", "layer", "clock", "night", "morning", "river", "stone", "quiet",
    "bright", "slow", "fast", "early", "late", "small", "large", "keeps", "writes", "reads",
    "stops", "starts", "waits", "resumes", "trains", "moves", "learns", "counts", "holds",
    "finds", "loses", "returns", "carries", "under", "over", "after", "before", "with",
    "without", "into", "from",
)


@dataclass
class TextConfig:
    corpus: str = ""             # a UTF-8 text file; empty: the generated corpus
    corpus_chars: int = 200_000  # size of the generated corpus
    seq_len: int = 64
    eval_fraction: float = 0.05  # the last samples, held out for evaluation (0 = none)

    def __post_init__(self) -> None:
        require(0 <= self.eval_fraction < 1, "data.eval_fraction", "must be in [0, 1)",
                self.eval_fraction)
        require(self.corpus_chars >= 1000, "data.corpus_chars", "must be >= 1000",
                self.corpus_chars)
        require(self.seq_len >= 2, "data.seq_len", "must be >= 2", self.seq_len)
        require(not self.corpus or Path(self.corpus).is_file(), "data.corpus",
                "must be an existing file", self.corpus)


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


class TextWindows(Dataset):
    """Fixed-length windows of a byte stream; ``__getitem__`` gives (inputs, targets)."""

    vocab_size = 256  # bytes

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    @classmethod
    def from_config(cls, cfg: TextConfig) -> TextWindows:
        if cfg.corpus:
            try:
                text = Path(cfg.corpus).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"data.corpus {cfg.corpus!r} cannot be read as UTF-8 "
                                  f"text: {exc}") from None
        else:
            text = generate_corpus(cfg.corpus_chars)
        tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        if len(tokens) <= cfg.seq_len:
            raise ConfigError(f"data.corpus has {len(tokens)} bytes, fewer than one sample of "
                              f"data.seq_len={cfg.seq_len} + 1")
        return cls(tokens, cfg.seq_len)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1]
        return window[:-1], window[1:]
