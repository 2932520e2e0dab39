"""What the history says about the plan's inputs, and the notice when it disagrees.

``measured`` and ``inputs_from`` give what ``plan --from-history`` plans with (the MTBI, the
crash and node-loss shares, R and R_in: docs/GOODPUT.md, "The measured MTBI");
``mtbi_notice`` is the line ``plan`` and ``resume`` print, unasked, when the measured
interval excludes the configured MTBI. The config is never changed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import PACKAGE
from ..checkpoint.store.storage import Storage, open_storage
from ..config import Config
from ..interval.formulas import recommended_interval_steps
from ..interval.inputs import Inputs, MetricsError, configured_inputs, read_metrics
from ..runtime.metrics import read_events
from .accounts import Ledger, account
from .history import read_history
from .mtbi import MIN_COUNT, MTBI, Share, describe, duration, measure_mtbi, share

CRASHES = ("crash", "rank_lost", "hang")   # a crash keeps the node (the plan's c)


@dataclass(frozen=True)
class Measured:
    mtbi: MTBI
    crash_share: Share
    node_loss_share: Share
    restart_s: float | None      # R: mean downtime of rescheduled interruptions
    in_place_restart_s: float | None   # R_in: mean downtime of in-place restarts


def measured(ledger: Ledger) -> Measured:
    kinds = [i["kind"] for i in ledger.interruptions]
    n = len(kinds)

    def mean(in_place: bool) -> float | None:
        values = [i["downtime_s"] for i in ledger.interruptions
                  if i["downtime_s"] is not None and i.get("in_place", False) == in_place]
        return sum(values) / len(values) if values else None

    return Measured(measure_mtbi(n, ledger.exposure_s),
                    share(sum(k in CRASHES for k in kinds), n),
                    share(kinds.count("node_lost"), n), mean(False), mean(True))


def run_ledger(cfg: Config) -> tuple[Ledger, int, bool]:
    """(ledger, unreadable history records, has metrics); LookupError when nothing is recorded."""
    storage = open_storage(cfg.checkpoint.dir)
    records, skipped = read_history(storage)
    events, _ = read_events(cfg.log.dir)
    if not records and not events:
        raise LookupError(f"nothing is recorded yet: no history in {storage}/history and no "
                          f"events in {cfg.log.dir}/metrics.jsonl (train first)")
    return account(records, events), skipped, bool(events)


def inputs_from(base: Inputs, found: Measured) -> Inputs:
    """``base`` with the measured MTBI, shares and restart time (those measured)."""
    if not found.mtbi.enough:
        raise ValueError(f"{describe(found.mtbi)}: fewer than {MIN_COUNT} interruptions are "
                         "too few to plan with; plan from the config until more are seen")
    changes = {"mtbi_hours": found.mtbi.estimate_s * base.nodes / 3600.0,
               "crash_share": found.crash_share.estimate,
               "node_loss_share": found.node_loss_share.estimate}
    if found.restart_s is not None:
        changes["restart_seconds"] = found.restart_s
    return dataclasses.replace(base, **changes)


def mtbi_notice(cfg: Config, storage: Storage, base: Inputs) -> str | None:
    """One line when the measured MTBI's interval excludes the configured one, else None."""
    records, _ = read_history(storage)   # the history alone: cheap, one small object a start
    if not records:
        return None
    found = measured(account(records, []))
    configured_s = cfg.plan.mtbi_hours * 3600.0 / cfg.plan.nodes
    if not found.mtbi.excludes(configured_s):
        return None
    steps = recommended_interval_steps(dataclasses.replace(
        base, mtbi_hours=found.mtbi.estimate_s * base.nodes / 3600.0))
    return (f"notice: {describe(found.mtbi)}; configured {duration(configured_s)} "
            f"(plan.mtbi_hours{' / plan.nodes' if cfg.plan.nodes > 1 else ''}): the interval "
            f"would be {steps} steps, not {cfg.checkpoint.interval_steps} "
            f"(plan with it: python -m {PACKAGE}.plan --from-history; the config is unchanged)")


def planned_inputs(cfg: Config, has_metrics: bool) -> Inputs:
    """The plan's inputs: the config's answers, with T, δ and L as training measured
    them when metrics.jsonl has them (the MTBI stays the configured one)."""
    inputs = configured_inputs(cfg)
    if has_metrics:
        try:
            measured = read_metrics(cfg.log.dir)
        except (MetricsError, OSError):
            return inputs
        inputs = dataclasses.replace(inputs, step_seconds=measured.step_seconds,
                                     blocking_seconds=measured.blocking_seconds,
                                     commit_latency_seconds=measured.commit_latency_seconds)
    return inputs
