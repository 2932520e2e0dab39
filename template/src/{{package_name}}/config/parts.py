"""The harness's optional parts, and whether this project was rendered with each.

copier renders five parts only when their question says so (copier.yml; default: what a
single-node job needs). The harness imports a part only where a setting turns it on, and
refuses such a setting up front (exit 2) when the part is absent, naming the copier answer
that adds it; docs/EXTENDING.md, "Optional parts".
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import NamedTuple

PACKAGE = __package__.rpartition(".")[0]


class Part(NamedTuple):
    module: str     # below the package
    answer: str     # the copier answer that renders it
    what: str


MEMORY_TIER = Part("checkpoint.memory", "memory_tier=true", "the memory tier")
TRACKERS = Part("tracking", "trackers=true", "the experiment trackers")
CLOUD_NOTICES = Part("preemption.notices", "cloud={cloud}", "the cloud notice pollers")
STRAGGLERS = Part("recovery.stragglers", "straggler_detection=true", "straggler detection")
NODE_DRILL = Part("tools.drill_nodes", "multi_node_drill=true", "the multi-node drill")
PARTS = (MEMORY_TIER, TRACKERS, CLOUD_NOTICES, STRAGGLERS, NODE_DRILL)


def rendered(part: Part) -> bool:
    """Whether this project holds ``part`` (copier rendered it)."""
    return find_spec(f"{PACKAGE}.{part.module}") is not None


def missing(part: Part, setting: str, **answer: str) -> str:
    """The sentence for a setting that turns on a part this project was rendered without."""
    return (f"{setting} turns on {part.what}, which this project was rendered without: add "
            f"it with `copier update --data {part.answer.format(**answer)}` "
            "(docs/EXTENDING.md, \"Optional parts\")")
