"""Any Hugging Face ``transformers`` causal language model: the default task's ``model.kind: hf``.

The ``model:`` keys: ``HFConfig`` and docs/EXTENDING.md, "Train a Hugging Face model on your
corpus". Weights stay in fp32; nothing is downloaded; transformers is an optional
dependency (``pip install -e '.[hf]'``), imported here only.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
INSTALL_HINT = "pip install -e '.[hf]' (transformers, tokenizers, safetensors)"


@dataclass
class HFConfig:
    path: str = ""              # local directory with config.json (+ weights), or a cached hub name
    config_class: str = ""      # or: a transformers configuration class, e.g. LlamaConfig
    config: dict[str, Any] = field(default_factory=dict)  # overrides of its fields
    attn_implementation: str = ""  # empty: transformers' default (sdpa where supported)

    def __post_init__(self) -> None:
        if bool(self.path) == bool(self.config_class):
            raise ConfigError("model.kind=hf needs exactly one of model.path (a local model "
                              "directory) and model.config_class (e.g. LlamaConfig); got "
                              f"path={self.path!r}, config_class={self.config_class!r}")


def transformers_module():
    """transformers, imported without network access; ConfigError when it is missing."""
    # Nothing is downloaded at run time: a hub name works only from the local cache.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.kind=hf needs transformers: {INSTALL_HINT}") from None
    return transformers


def model_dir(path: str) -> Path:
    """``model.path`` as a local directory: the path itself, or a hub name's cached copy."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path {path!r} has no config.json")
        return local
    transformers_module()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a repo name, or not cached: the same answer
        raise ConfigError(
            f"model.path {path!r} is neither a local directory nor a model in the Hugging "
            "Face cache; nothing is downloaded during training, so download it first "
            f"(e.g. `hf download {path}`) or give its directory") from None


def hf_config(cfg: HFConfig):
    """The transformers configuration ``cfg`` describes, ``model.config`` passed to the
    constructor so that derived fields such as ``head_dim`` follow it."""
    transformers = transformers_module()
    if cfg.config_class:
        cls = getattr(transformers, cfg.config_class, None)
        if not (inspect.isclass(cls) and issubclass(cls, transformers.PretrainedConfig)):
            raise ConfigError(f"model.config_class: {cfg.config_class!r} is not a configuration "
                              "class of transformers (e.g. LlamaConfig, Qwen2Config, GPT2Config)")
        base: dict[str, Any] = {}
    else:
        directory = model_dir(cfg.path)
        try:
            base = json.loads((directory / "config.json").read_text(encoding="utf-8"))
            cls = transformers.CONFIG_MAPPING[base.pop("model_type")]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model.path {cfg.path!r}: config.json is not a transformers "
                              f"configuration ({type(exc).__name__}: {exc})") from None
    default = cls()
    known = set(inspect.signature(cls.__init__).parameters) | set(vars(default))
    for key in cfg.config:
        if key not in known and not hasattr(default, key):  # hasattr: aliases such as n_embd
            raise ConfigError(f"model.config.{key}: not a field of {cls.__name__}")
    return cls(**{**base, **cfg.config})


def build_hf_model(cfg: HFConfig, *, load_weights: bool) -> nn.Module:
    """The causal LM in fp32: pretrained weights from ``model.path`` when ``load_weights`` and
    it has them, else initialised from the configuration (seeded by the caller)."""
    config = hf_config(cfg)
    options: dict[str, Any] = {"dtype": torch.float32}
    if cfg.attn_implementation:
        options["attn_implementation"] = cfg.attn_implementation
    building_on_meta = torch.get_default_device().type == "meta"  # a configuration check
    directory = model_dir(cfg.path) if cfg.path else None
    auto = transformers_module().AutoModelForCausalLM
    try:
        if load_weights and directory is not None and not building_on_meta \
                and any((directory / name).is_file() for name in WEIGHT_FILES):
            if os.environ.get("RANK", "0") == "0":
                log.info("loading pretrained weights from %s (first start of this run)", directory)
            model = auto.from_pretrained(directory, config=config, local_files_only=True, **options)
        else:
            model = auto.from_config(config, **options)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ConfigError(f"model: {type(config).__name__} has no causal language model in "
                          "transformers (AutoModelForCausalLM)") from None
    # Training never reads the key/value cache, which activation checkpointing would regrow.
    model.config.use_cache = False
    return model


def check_data_fits(model: nn.Module, vocab_size: int, seq_len: int) -> None:
    """Refuse more token ids than the model has embeddings, or windows past its positions."""
    embeddings = model.get_input_embeddings().num_embeddings
    if vocab_size > embeddings:
        raise ConfigError(
            f"the data's vocabulary has {vocab_size} tokens but the model's has {embeddings}: "
            f"set model.config.vocab_size={vocab_size} (or more), or prepare the data with the "
            "model's tokenizer")
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(model.config, name, None)
        if isinstance(limit, int) and seq_len > limit:
            raise ConfigError(f"data.seq_len={seq_len} is longer than the model's "
                              f"{name}={limit}")
