"""The contract between the harness and the user's task module (task.py).

``load_task`` fills in defaults for the optional functions, so the harness calls one
``Task`` and never the module. What each function must do: docs/EXTENDING.md.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from .. import PACKAGE
from ..config import Config, ConfigError, TaskContext
from ..config.schedule import lr_factor
from ..config.yaml_file import shown

REQUIRED = ("build_model", "build_data", "loss_and_metrics")
OPTIONAL = ("collate", "build_optimizer", "shard_units")
# Optional, no default: no evaluation without build_eval_data.
EVALUATION = ("build_eval_data", "eval_metrics", "eval_summary")
Optimizers = tuple[torch.optim.Optimizer, "torch.optim.lr_scheduler.LRScheduler | None"]
# Modules moved by the reorganisation into folders (CHANGELOG.md): old -> new, relative to
# the package. A task importing an old one is told the new import (exit 2). The command
# entries, config/, preemption/ and launch/ stayed importable: for them, moved names count.
MOVED_MODULES = {
    **{name: (f"loop.{name}",) for name in ("trainer", "sampling", "task_contract")},
    **{name: (f"runtime.{name}",) for name in ("exit_codes", "metrics")},
    **{name: (f"recovery.{name}",) for name in ("watchdog", "progress_guard", "stragglers")},
    **{name: (f"tools.{name}",) for name in (
        "bench_loop", "bench_report", "drill_report", "tokenizer", "plan", "bench", "drill",
        "export", "verify", "memcheck", "prepare_data")},
    "distributed": ("runtime.distributed", "loop.parallelize"),
    "stop": ("preemption.stop", "checkpoint.policy", "checkpoint.final_save"),
    "preemption": ("preemption.watch",), "exits": ("recovery.attempts", "runtime.exit_codes"),
    "launch": ("launch.torchrun",), "launch.command": ("launch.torchrun",),
    "plan_model": ("interval.formulas",), "plan_report": ("interval.report",),
    "plan_plot": ("interval.plot",), "config": ("config.schema", "config.schedule"),
    "checkpoint.planner": ("checkpoint.save.dcp_planner",),
    # checkpoint/ in wings (CHANGELOG.md, Unreleased).
    **{f"checkpoint.{old}": (f"checkpoint.{new}",) for old, new in (
        ("manager", "save.pipeline"), ("staging", "save.staging"),
        ("background", "save.background"), ("dcp_planner", "save.dcp_planner"),
        ("memory_tier", "memory.tier"), ("memory", "memory.copies"),
        ("partners", "memory.partners"), ("storage", "store.storage"),
        ("layout", "store.layout"), ("lease", "store.lease"), ("outage", "store.outage"),
        ("integrity", "store.integrity"), ("restore", "load.restore"),
        ("reader", "load.reader"), ("safe_load", "load.safe_load"),
        ("compat", "load.compat"))},
    "train": ("loop.job",), "resume": ("launch.supervisor",),
}


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
        try:
            from .. import task as module
        except ImportError as exc:  # ModuleNotFoundError too
            if (moved := moved_import(exc)) is None:
                raise
            raise ConfigError(moved) from None
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ConfigError(f"{module.__name__} must define {', '.join(missing)} "
                          "(see docs/EXTENDING.md)")
    defaults = {"collate": default_collate, "build_optimizer": default_optimizer,
                "shard_units": default_shard_units}
    chosen = {name: getattr(module, name, None) or defaults.get(name)
              for name in (*REQUIRED, *OPTIONAL, *EVALUATION)}
    chosen["build_model"] = _with_context(chosen["build_model"])
    return Task(**chosen)


def _with_context(build_model: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``build_model(cfg, ctx)``, calling an older ``build_model(cfg)`` with the config alone."""
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


# Value fills, skipped on the meta device: some meta kernels import torch._dynamo on first
# use (seconds of CPU for resume, which checks the task's model before torchrun starts).
_VALUE_FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "fill_", "zero_", "zeros_",
                          "ones_", "constant_", "erfinv_", "clamp_", "exponential_",
                          "bernoulli_", "random_", "log_normal_", "cauchy_", "geometric_"})


class _NoMetaFills(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")   # torch.nn.init passes it by name
        if (getattr(func, "__name__", "") in _VALUE_FILLS and isinstance(target, torch.Tensor)
                and target.is_meta):
            return target
        return func(*args, **kwargs)


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device: the model's shapes, no memory and no initialisation."""
    with torch.device("meta"), _NoMetaFills():
        return build()


def check_config(task: Task, cfg: Config) -> None:
    """Let the task refuse its configuration (ConfigError) by building the model on meta;
    any other error is left for the run to report."""
    try:
        build_on_meta(lambda: task.build_model(cfg))
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001, S110 - e.g. a model that cannot be built on meta
        pass


# ------------------------------------------------------------ moved modules --

def moved_import(exc: ImportError) -> str | None:
    """For an import of a MOVED_MODULES module (else None): where, what moved, the new import."""
    old, names = _old_module(exc)
    if old not in MOVED_MODULES:
        return None
    where, statement = _import_site(exc)
    gone = isinstance(exc, ModuleNotFoundError) or exc.name == PACKAGE  # the module itself
    if statement is not None and statement.module is not None and (
            statement.module == old or statement.module.endswith("." + old)):
        names = [alias.name for alias in statement.names if alias.name != "*"
                 and (gone or not _defines(old, alias.name))] or names
    homes = {name: _home(MOVED_MODULES[old], name) for name in names}
    verified = bool(names) and None not in homes.values()
    if not verified and not gone:
        return None                 # a name that was never there: Python's own error
    targets = ([new for new in MOVED_MODULES[old] if new in homes.values()] if verified
               else list(MOVED_MODULES[old]))
    what = f"{PACKAGE}.{old}" if gone else f"{', '.join(names)} from {PACKAGE}.{old}"
    imports = []
    if statement is not None:
        prefix = "." * statement.level if statement.level else f"{PACKAGE}."
        if verified:
            imports = [f"from {prefix}{new} import "
                       f"{', '.join(n for n in names if homes[n] == new)}" for new in targets]
        elif statement.module is None and len(targets) == 1:   # `from . import trainer`
            parent, _, leaf = targets[0].rpartition(".")
            rename = f" as {old}" if leaf != old else ""
            imports = [f"from {prefix}{parent} import {leaf}{rename}"]
    fix = "change the import" + (" to " + " and ".join(f"`{i}`" for i in imports)
                                 if imports else "")
    return (f"{where} imports {what}, which moved to "
            f"{' and '.join(f'{PACKAGE}.{new}' for new in targets)} in the reorganisation "
            f"of the package into folders (CHANGELOG.md): {fix}")


def _old_module(exc: ImportError) -> tuple[str | None, list[str]]:
    """The package-relative module the failed import named, and the names the error gives."""
    name = exc.name or ""
    if not (name == PACKAGE or name.startswith(PACKAGE + ".")):
        return None, []
    relative = name[len(PACKAGE) + 1:]
    if isinstance(exc, ModuleNotFoundError):
        return relative, []
    if (found := re.match(r"cannot import name '([^']+)'", str(exc))) is None:
        return None, []
    if not relative:                        # `from . import trainer`
        return found.group(1), []
    return relative, [found.group(1)]


def _import_site(exc: ImportError) -> tuple[str, ast.ImportFrom | None]:
    """``src/<package>/task.py line 3`` (the innermost frame that is not importlib's) and
    its ``from ... import`` statement, when the file can be parsed."""
    frames = [(frame, line) for frame, line in traceback.walk_tb(exc.__traceback__)
              if not frame.f_code.co_filename.startswith("<")]
    if not frames:
        return f"src/{PACKAGE}/task.py", None
    path, line = Path(frames[-1][0].f_code.co_filename), frames[-1][1]
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return f"{shown(path)} line {line}", None
    statement = next((node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and node.lineno <= line <= (node.end_lineno or node.lineno)), None)
    return f"{shown(path)} line {line}", statement


def _home(modules: tuple[str, ...], name: str) -> str | None:
    """The one of ``modules`` that defines ``name``; else the first that has it (imported)."""
    having = [module for module in modules if _defines(module, name)]
    defining = [module for module in having if getattr(getattr(
        importlib.import_module(f"{PACKAGE}.{module}"), name), "__module__", None)
        == f"{PACKAGE}.{module}"]
    return (defining or having or [None])[0]


def _defines(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(f"{PACKAGE}.{module}"), name)
    except ImportError:
        return False


# ------------------------------------------------------------------ defaults --

def default_optimizer(model: nn.Module, cfg: Config) -> Optimizers:
    """AdamW with linear warm-up and cosine decay, from the ``train:`` section."""
    train = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr,
                                  weight_decay=train.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, train.warmup_steps, train.max_steps,
                                       train.min_lr_ratio))


def default_shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 shards before the root: a Hugging Face model's
    ``_no_split_modules`` classes, else ``blocks`` or ``layers``, else none (one unit)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    for attr in ("blocks", "layers"):
        units = getattr(model, attr, None)
        if isinstance(units, (nn.ModuleList, nn.Sequential)):
            return list(units)
    return []
