"""Your task: the model, the data, the loss and the metrics. This is the file to edit.

The harness (trainer, checkpointing, preemption, launch) calls the functions below and
nothing else of yours; docs/EXTENDING.md gives the contract and what the harness
guarantees in return. Required: ``build_model``, ``build_data``, ``loss_and_metrics``.
Optional, with the harness's defaults when absent: ``collate`` (default_collate),
``build_optimizer`` (AdamW with warm-up and cosine decay from ``train.*``) and
``shard_units`` (the submodules FSDP2 shards one by one).

``cfg.model`` and ``cfg.data`` are the ``model:`` and ``data:`` sections of
configs/train.yaml as plain dicts: yours to define. ``task_section`` checks them
against a dataclass, with the harness's error messages for a bad key or value.

This default trains a small byte-level language model on a generated corpus.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config, task_section
from .datasets import TextConfig, TextWindows
from .models import TinyConfig, TinyLM

HARNESS_DATA_KEYS = ("num_workers",)  # data.num_workers is read by the harness


def build_model(cfg: Config) -> nn.Module:
    model = task_section(cfg.model, TinyConfig, "model")
    data = task_section(cfg.data, TextConfig, "data", ignore=HARNESS_DATA_KEYS)
    return TinyLM(model, max_seq_len=data.seq_len)


def build_data(cfg: Config) -> TextWindows:
    return TextWindows.from_config(task_section(cfg.data, TextConfig, "data",
                                                ignore=HARNESS_DATA_KEYS))


def loss_and_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss, {}
