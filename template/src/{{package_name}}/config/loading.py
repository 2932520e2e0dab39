"""Loading the configuration: configs/train.yaml merged with ``key=value`` overrides, the
keys that moved, and ``task_section``: a task's own sections checked with the same messages.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .checks import ConfigError
from .schema import TASK_SECTIONS, Config
from .yaml_file import UnreadableConfig, read_yaml

DEFAULT_CONFIG = Path("configs/train.yaml")
# Harness settings that used to live in the task's ``data:`` section, and where they are now.
MOVED_KEYS = {"data.num_workers": "loader.num_workers",
              "data.prefetch_factor": "loader.prefetch_factor"}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """configs/train.yaml (or ``path``) with ``key=value`` overrides; ConfigError names the key."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found (pass --config PATH)")
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        _check_override_key(key)
        if not value and key.split(".")[0] not in TASK_SECTIONS:
            raise ConfigError(f"{key}: no value given (write {key}=VALUE)")
    try:
        values = read_yaml(path)  # conflict markers and YAML errors: file, line, what to do
    except UnreadableConfig as exc:
        raise ConfigError(str(exc)) from None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), values,
                                 OmegaConf.from_dotlist(list(overrides)))
        _move_old_keys(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        # The first line says what is wrong (for a typo, with a suggestion); full_key says where.
        message = str(exc).split("\n")[0].strip()
        key = getattr(exc, "full_key", None)
        raise ConfigError(f"{key}: {message}" if key and key not in message else message) from None


def _move_old_keys(merged: Any) -> None:
    """A moved key (MOVED_KEYS) still works: its value goes to the new key, with a notice."""
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        values = merged[section]
        if key in values:
            value = values.pop(key)
            OmegaConf.update(merged, new, value)
            print(f"notice: {old} is now {new} (set {new}={value} instead; the old key keeps "
                  "working for now)", file=sys.stderr)


def _check_override_key(key: str) -> None:
    """Name the section of a key given without one (``max_steps`` -> ``train.max_steps``)."""
    sections = [f.name for f in dataclasses.fields(Config)]
    if "." in key or key in sections:
        return
    owners = [f.name for f in dataclasses.fields(Config) if f.name not in TASK_SECTIONS
              and key in {g.name for g in dataclasses.fields(f.default_factory())}]
    hint = (f"did you mean {' or '.join(f'{o}.{key}' for o in owners)}?" if owners
            else f"keys are section.name, sections: {', '.join(sections)}")
    raise ConfigError(f"{key}: not a key of the configuration; {hint}")


def to_plain_dict(config: Config) -> dict:
    """The resolved configuration as plain data (enums as strings), for commit.json."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True,
                                  enum_to_str=True)


Section = TypeVar("Section")


def task_section(values: dict[str, Any], schema: type[Section], prefix: str,
                 ignore: tuple[str, ...] = ()) -> Section:
    """Check a task-owned section (``model:``, ``data:``) against a dataclass of the task's:
    unknown keys, wrong types and its ``__post_init__`` checks raise ConfigError naming
    ``prefix.key`` (exit 2, no traceback). Keys in ``ignore`` belong to the harness."""
    kept = {k: v for k, v in values.items() if k not in ignore}
    known = {f.name for f in dataclasses.fields(schema)}
    for key in kept:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}: not a key of {prefix} (known: "
                              f"{', '.join(sorted(known))})")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), kept)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        message = str(exc).split("\n")[0].strip()
        key = getattr(exc, "full_key", None)
        where = f"{prefix}.{key}" if key else prefix
        raise ConfigError(f"{where}: {message}") from None


def task_section_of_kind(values: dict[str, Any], kinds: dict[str, type], prefix: str,
                         default: str, ignore: tuple[str, ...] = ()) -> tuple[str, Any]:
    """``task_section`` where the ``kind`` key chooses the dataclass: (kind, checked section).
    The other kinds' keys may stay (configs/train.yaml lists them all), unchecked; a key of
    no kind is refused like any unknown key."""
    kind = values.get("kind", default)
    if kind not in kinds:
        raise ConfigError(f"{prefix}.kind must be one of {', '.join(kinds)} (got {kind!r})")
    own = {f.name for f in dataclasses.fields(kinds[kind])}
    others = {f.name for schema in kinds.values() for f in dataclasses.fields(schema)} - own
    return kind, task_section(values, kinds[kind], prefix, ignore=("kind", *others, *ignore))
