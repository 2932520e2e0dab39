"""Your task: the model, the data, the loss and the metrics. This is the file to edit.

``copier update`` never writes this file (nor any file you add); it merges its changes
into configs/train.yaml and pyproject.toml, keeping your values; every other file is the
template's, ``models/`` and ``datasets/`` included: to change one, copy it beside this
file under a name of your own (docs/EXTENDING.md, "Who owns what").

The harness (trainer, checkpointing, preemption, launch) calls the functions below and
nothing else of yours; docs/EXTENDING.md gives the contract and what the harness
guarantees in return. Required: ``build_model``, ``build_data``, ``loss_and_metrics``.
``build_model(cfg, ctx)`` gets what the harness knows about this run in ``ctx``
(``first_start``, ``rank``, ``world_size``, ``device``); ``build_model(cfg)`` works too.
Optional, with the harness's defaults when absent: ``collate`` (default_collate),
``build_optimizer`` (AdamW with warm-up and cosine decay from ``train.*``) and
``shard_units`` (the submodules FSDP2 shards one by one). Evaluation, optional:
``build_eval_data`` (held-out samples; without it nothing is evaluated), ``eval_metrics``
(default: ``loss_and_metrics`` under ``torch.no_grad()`` in eval mode) and
``eval_summary`` (figures derived from the evaluation's means, e.g. the perplexity).

``cfg.model`` and ``cfg.data`` are the ``model:`` and ``data:`` sections of
configs/train.yaml as plain dicts: yours to define. ``task_section`` checks them
against a dataclass, with the harness's error messages for a bad key or value.

This default trains a causal language model on next-token prediction:
``model.kind`` tiny (a small byte-level transformer) or hf (any Hugging Face causal LM),
``data.kind`` text (bytes of a text file or of a generated corpus) or tokens (a
directory written by ``python -m <package>.prepare_data``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

from .config import Config, TaskContext, task_section_of_kind
from .datasets import TextConfig, TextWindows, TokenConfig, TokenWindows, read_index
from .models import HFConfig, TinyConfig, TinyLM, build_hf_model, check_data_fits

MODELS = {"tiny": TinyConfig, "hf": HFConfig}
DATA = {"text": TextConfig, "tokens": TokenConfig}


def _data_section(cfg: Config) -> tuple[str, TextConfig | TokenConfig]:
    return task_section_of_kind(cfg.data, DATA, "data", default="text")


def build_model(cfg: Config, ctx: TaskContext) -> nn.Module:
    kind, model = task_section_of_kind(cfg.model, MODELS, "model", default="tiny")
    data_kind, data = _data_section(cfg)
    vocab = read_index(data.path)["vocab_size"] if data_kind == "tokens" else 256
    if kind == "tiny":
        return TinyLM(model, max_seq_len=data.seq_len, vocab_size=vocab)
    # Pretrained weights (model.path) at the first start only: a resume loads the checkpoint.
    hf_model = build_hf_model(model, load_weights=ctx.first_start)
    check_data_fits(hf_model, vocab, data.seq_len)
    return hf_model


def build_data(cfg: Config) -> Dataset:
    return _held_out(cfg)[0]


def build_eval_data(cfg: Config) -> Dataset:
    """The last ``data.eval_fraction`` of the samples, never trained on."""
    return _held_out(cfg)[1]


def _held_out(cfg: Config) -> tuple[Dataset, Dataset]:
    kind, data = _data_section(cfg)
    windows = (TokenWindows.from_config(data) if kind == "tokens"
               else TextWindows.from_config(data))
    held = int(len(windows) * data.eval_fraction)
    return (Subset(windows, range(len(windows) - held)),
            Subset(windows, range(len(windows) - held, len(windows))))


def loss_and_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    logits = model(inputs)
    logits = getattr(logits, "logits", logits)  # Hugging Face models return an output object
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss, {}



def eval_summary(means: dict[str, float]) -> dict[str, float]:
    """Figures of the whole evaluation, from its sample-weighted means: the perplexity is
    exp of the mean loss (a mean of per-batch perplexities would depend on how the eval
    set was cut into batches, and so on the number of ranks)."""
    return {"perplexity": math.exp(means["loss"])}
