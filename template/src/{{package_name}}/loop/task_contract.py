"""The contract between the harness and the user's task module (task.py).

``load_task`` reads the task's functions and fills in the harness's defaults for the
optional ones, so the rest of the harness calls one ``Task`` and never the module.
What each function must do is written in docs/EXTENDING.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from ..config import Config, ConfigError, TaskContext
from ..config.schedule import lr_factor

REQUIRED = ("build_model", "build_data", "loss_and_metrics")
OPTIONAL = ("collate", "build_optimizer", "shard_units")
# Optional, no default: no evaluation without build_eval_data.
EVALUATION = ("build_eval_data", "eval_metrics", "eval_summary")
Optimizers = tuple[torch.optim.Optimizer, "torch.optim.lr_scheduler.LRScheduler | None"]


@dataclass(frozen=True)
class Task:
    build_model: Callable[..., nn.Module]        # (cfg, ctx: TaskContext | None = None)
    build_data: Callable[[Config], Any]
    loss_and_metrics: Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]
    collate: Callable[[list[Any]], Any]
    build_optimizer: Callable[[nn.Module, Config], Optimizers]
    shard_units: Callable[[nn.Module], list[nn.Module]]
    build_eval_data: Callable[[Config], Any] | None = None
    eval_metrics: Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]] | None = None
    eval_summary: Callable[[dict[str, float]], dict[str, float]] | None = None


def load_task(module: ModuleType | None = None) -> Task:
    """The task's functions, with defaults for the optional ones missing from ``module``."""
    if module is None:
        from .. import task as module
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ConfigError(f"{module.__name__} must define {', '.join(missing)} "
                          "(see docs/EXTENDING.md)")
    defaults = {"collate": default_collate, "build_optimizer": default_optimizer,
                "shard_units": default_shard_units}
    chosen = {name: getattr(module, name) for name in REQUIRED}
    chosen["build_model"] = _with_context(chosen["build_model"])
    for name in OPTIONAL:
        chosen[name] = getattr(module, name, None) or defaults[name]
    for name in EVALUATION:
        chosen[name] = getattr(module, name, None)
    return Task(**chosen)


def _with_context(build_model: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``build_model(cfg, ctx)``, or the older ``build_model(cfg)`` given the config alone
    (task files written before the context existed keep working)."""
    try:
        params = inspect.signature(build_model).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: call it as before
        params = ()
    takes_context = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                        for p in params) >= 2

    def build(cfg: Config, ctx: TaskContext | None = None) -> nn.Module:
        if takes_context:
            return build_model(cfg, ctx if ctx is not None else TaskContext())
        return build_model(cfg)

    build.__wrapped__ = build_model  # type: ignore[attr-defined]
    return build


def check_config(task: Task, cfg: Config) -> None:
    """Let the task refuse its configuration before anything runs (raises ConfigError).

    The model is built on the meta device: no memory for weights, no time to initialise
    them. Only ConfigError counts here; anything else is left for the run to report.
    """
    try:
        with torch.device("meta"):
            task.build_model(cfg)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001, S110 - e.g. a model that cannot be built on meta
        pass


# ------------------------------------------------------------------ defaults --

def default_optimizer(model: nn.Module, cfg: Config) -> Optimizers:
    """AdamW with linear warm-up and cosine decay, from the ``train:`` section."""
    train = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr,
                                  weight_decay=train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, train.warmup_steps, train.max_steps,
                                       train.min_lr_ratio))
    return optimizer, scheduler


def default_shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 shards one by one before the root.

    A Hugging Face model names its layer classes in ``_no_split_modules``; otherwise a
    ``blocks`` or ``layers`` list; otherwise none (the whole model is one unit).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    for attr in ("blocks", "layers"):
        units = getattr(model, attr, None)
        if isinstance(units, (nn.ModuleList, nn.Sequential)):
            return list(units)
    return []
