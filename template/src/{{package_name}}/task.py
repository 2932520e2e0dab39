"""Your task: the model, the data, the loss and the metrics. This is the file to edit.

The harness calls the functions below and nothing else of yours; docs/EXTENDING.md, "The
contract", says when each is called, what it must return, and what the harness
guarantees in return. Required: ``build_model(cfg, ctx)`` (or ``build_model(cfg)``),
``build_data``, ``loss_and_metrics``. Optional: ``collate``, ``build_optimizer``,
``shard_units``, and for evaluation ``build_eval_data``, ``eval_metrics``, ``eval_summary``.
``cfg.model`` and ``cfg.data`` are your sections of configs/train.yaml, as plain dicts;
``task_section`` checks one against a dataclass of yours.

``copier update`` never writes this file (docs/EXTENDING.md, "Who owns what"). This
default trains a causal language model on next-token prediction: ``model.kind`` tiny or
hf, ``data.kind`` text or tokens (docs/EXTENDING.md, "Where the default task comes from").
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
    """Figures of the whole evaluation from its sample-weighted means: perplexity is exp of
    the mean loss (a mean of per-batch perplexities would depend on the number of ranks)."""
    return {"perplexity": math.exp(means["loss"])}
