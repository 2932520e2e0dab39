"""The config's checks: ConfigError, ``require`` and the bounds declared beside the fields.

A field states its bound where it is declared (``lr: float = bounded(3e-3, above(0))``);
``check_bounds``, first in the section's ``__post_init__``, applies them in field order."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class Rule(NamedTuple):
    test: Callable[[Any], bool]   # true for a good value
    message: str                  # what a bad value must be: "must be >= 1"


def require(condition: bool, key: str, message: str, value: object) -> None:
    if not condition:
        raise ConfigError(f"{key} {message} (got {value!r})")


def at_least(low: float, note: str = "", noun: str = "", op: str = ">=") -> Rule:
    """``value >= low`` (or ``op`` ">"), said "must be [noun] >= low[note]"; a noun saying
    "finite" also refuses NaN and ±inf."""
    holds, finite = operator.ge if op == ">=" else operator.gt, "finite" in noun
    return Rule(lambda v: (not finite or math.isfinite(v)) and holds(v, low),
                f"must be {noun + ' ' if noun else ''}{op} {low}{note}")


def above(low: float, note: str = "", noun: str = "") -> Rule:
    return at_least(low, note, noun, ">")


def one_of(choices: tuple[str, ...], message: str = "") -> Rule:
    return Rule(lambda v: v in choices, message or f"must be one of {', '.join(choices)}")


def bounded(default: T, *rules: Rule) -> T:
    """A field with ``default`` whose value must pass ``rules``."""
    return dataclasses.field(default=default, metadata={"rules": rules})


def each(*rules: Rule) -> dict[str, Any]:
    """A list field's metadata: each item must pass ``rules``."""
    return {"rules": rules, "each": True}


def check_bounds(section: Any, prefix: str) -> None:
    """Apply the rules of every field of ``section`` (ConfigError naming ``prefix.field``)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for item in value if f.metadata.get("each") else [value]:
            for rule in f.metadata.get("rules", ()):
                require(rule.test(item), f"{prefix}.{f.name}", rule.message, item)
