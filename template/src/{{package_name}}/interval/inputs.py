"""The plan's inputs as the config states them (its `plan:` section), one mapping for
every command that plans: ``plan``, ``goodput``, ``resume``'s notice."""

from __future__ import annotations

from ..config import Config
from .formulas import Inputs

# Inputs field -> (command-line flag, key in the config's `plan:` section)
FLAGS = {
    "mtbi_hours": ("--mtbi-hours", "mtbi_hours"),
    "step_seconds": ("--step-seconds", "step_time_s"),
    "blocking_seconds": ("--blocking-seconds", "checkpoint_save_s"),
    # Before anything is measured one save time stands for both δ and L.
    "commit_latency_seconds": ("--commit-latency-seconds", "checkpoint_save_s"),
    "restart_seconds": ("--restart-seconds", "restart_s"),
    "badput_target_percent": ("--badput-target-percent", "badput_target_percent"),
    "crash_share": ("--crash-share", "crash_share"),
    "nodes": ("--nodes", "nodes"),
    "node_loss_share": ("--node-loss-share", "node_loss_share"),
}


def configured_inputs(cfg: Config) -> Inputs:
    """The inputs the config plans with, before anything is measured."""
    return Inputs(**{field: getattr(cfg.plan, key) for field, (_, key) in FLAGS.items()})
