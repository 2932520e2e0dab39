"""A small decoder-only language model over bytes: the default task's model.

Configured by the ``model:`` section of configs/train.yaml (``TinyConfig``); its vocabulary
is the data's (256 bytes by default); FSDP2 shards its ``blocks`` one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import require
from ..config.checks import at_least, bounded, check_bounds

VOCAB_SIZE = 256  # bytes


@dataclass
class TinyConfig:
    d_model: int = bounded(64, at_least(1))
    n_layers: int = bounded(2, at_least(1))
    n_heads: int = bounded(4, at_least(1))
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_bounds(self, "model")
        require(self.d_model % max(1, self.n_heads) == 0, "model.d_model",
                f"must be a multiple of model.n_heads={self.n_heads}", self.d_model)
        require(0 <= self.dropout < 1, "model.dropout", "must be in [0, 1)", self.dropout)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, width)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyConfig, max_seq_len: int, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.pos = nn.Embedding(max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.dropout)
                                    for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.embed(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
