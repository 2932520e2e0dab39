"""The plan's inputs: :class:`Inputs`, what the model plans with, and its range check; where
each comes from in the config's `plan:` section (``FLAGS``, ``configured_inputs``: one mapping
for every command that plans); what training measured (``read_metrics``: T, δ, L, R_in, δ_m
from metrics.jsonl). docs/CHECKLIST.md ("Inputs") says what each input means."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import dataclass

from ..config import Config
from ..config.plan_defaults import CRASH_SHARE, NODE_LOSS_SHARE, SHARE_SLACK
from ..runtime.metrics import METRICS_FILE, Event, metrics_file, read_events


class PlanInputError(ValueError):
    """An input is out of range; ``field`` names the :class:`Inputs` field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Inputs:
    """M = mtbi_hours·3600/nodes, T = step_seconds, δ = blocking_seconds, L =
    commit_latency_seconds (>= δ), R = restart_seconds, c = crash_share, ν = node_loss_share."""

    mtbi_hours: float
    step_seconds: float
    blocking_seconds: float
    commit_latency_seconds: float
    restart_seconds: float
    badput_target_percent: float
    crash_share: float = CRASH_SHARE
    nodes: int = 1   # mtbi_hours is one node's; the job's MTBI is mtbi_hours / nodes
    node_loss_share: float = NODE_LOSS_SHARE   # ν: node losses, the partner's copy survives
    memory_blocking_seconds: float | None = None  # δ_m; None: δ (one copy into host memory)
    memory_send_seconds: float = 0.0  # sending the memory copy to the partner: L_m = δ_m + this

    @property
    def memory_blocking(self) -> float:
        """δ_m: the memory save's stall, the durable save's blocking time δ unless given."""
        given = self.memory_blocking_seconds
        return self.blocking_seconds if given is None else given

    @property
    def memory_commit_latency(self) -> float:
        """L_m = δ_m + the time to send the copy to the partner."""
        return self.memory_blocking + self.memory_send_seconds

    @property
    def mtbi_seconds(self) -> float:
        """M: the job's MTBI in seconds, the per-node MTBI divided by the node count."""
        return self.mtbi_hours * 3600.0 / self.nodes

    @property
    def job_mtbi_hours(self) -> float:
        return self.mtbi_hours / self.nodes

    @property
    def target(self) -> float:
        return self.badput_target_percent / 100

    def check(self) -> None:
        """Raise PlanInputError for the first input that is out of range."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "memory_blocking_seconds":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlanInputError(field.name, f"must be a number (got {value!r})")
            if not math.isfinite(value):
                raise PlanInputError(field.name, f"must be a finite number (got {value})")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise PlanInputError("nodes", f"must be a whole number >= 1 (got {self.nodes!r})")
        for name in ("mtbi_hours", "step_seconds"):
            if getattr(self, name) <= 0:
                raise PlanInputError(name, f"must be > 0 (got {getattr(self, name):g})")
        for name in ("blocking_seconds", "commit_latency_seconds", "restart_seconds"):
            if getattr(self, name) < 0:
                raise PlanInputError(name, f"must be >= 0 (got {getattr(self, name):g})")
        if self.commit_latency_seconds < self.blocking_seconds:
            raise PlanInputError(
                "commit_latency_seconds",
                f"must be >= the blocking time {self.blocking_seconds:g} s, since a save cannot "
                f"be committed before it stops blocking (got {self.commit_latency_seconds:g})",
            )
        if not 0 < self.badput_target_percent < 100:
            raise PlanInputError(
                "badput_target_percent",
                f"must be between 0 and 100, exclusive (got {self.badput_target_percent:g})",
            )
        for name in ("crash_share", "node_loss_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise PlanInputError(name, f"must be between 0 and 1 (got {getattr(self, name):g})")
        if self.crash_share + self.node_loss_share > 1 + SHARE_SLACK:
            raise PlanInputError(
                "node_loss_share",
                f"must be at most 1 - crash share = {1 - self.crash_share:g}: crashes, node "
                f"losses and job losses share the interruptions (got {self.node_loss_share:g})")
        for name in ("memory_blocking_seconds", "memory_send_seconds"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise PlanInputError(name, f"must be >= 0 (got {value:g})")


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


class MetricsError(ValueError):
    """metrics.jsonl is missing or holds too little to plan from."""


@dataclass(frozen=True)
class Measured:
    """T, δ and L as training measured them (field names as in :class:`Inputs`)."""

    path: str
    step_seconds: float
    step_count: int
    blocking_seconds: float
    commit_latency_seconds: float
    save_count: int
    save_reason: str  # "interval", or "all" when there were no interval saves
    warmup_excluded: int
    warmup_only: bool  # every save left was a warm-up, so they were kept
    latency_raised: bool  # the median latency came out below the median blocking time
    skipped_lines: int
    # R_in: median seconds from a failure to the first step of torchrun's in-place restarts
    # (``recovered`` events), None without any.
    in_place_restart_seconds: float | None = None
    in_place_restart_count: int = 0
    # δ_m and a memory copy's commit + send (``memory_save`` events, the first of each start
    # left out as a warm-up), None when the memory tier was off.
    memory_blocking_seconds: float | None = None
    memory_send_seconds: float | None = None
    memory_save_count: int = 0


def read_metrics(path: str | os.PathLike) -> Measured:
    """Medians of step time, save blocking time and commit latency from metrics.jsonl; the
    first save after each start, a warm-up (a process save starts its writer then), is left
    out while others remain; ``recovered`` events give R_in, ``memory_save`` events δ_m."""
    path = metrics_file(path)
    if not path.is_file():
        raise MetricsError(f"{path}: no such file (training writes it to <log.dir>/{METRICS_FILE})")
    step_times: list[float] = []
    saves: list[tuple[str, float, float, bool]] = []  # reason, blocking, latency, warm-up
    in_place: list[float] = []
    memory: list[tuple[float, float]] = []   # stall, commit + send
    first_save_of_run = first_memory_of_run = True
    events, skipped = read_events(path, Event.start, Event.step, Event.save, Event.recovered,
                                  Event.memory_save)
    for record in events:
        kind = record["event"]
        if kind == Event.memory_save:
            if not first_memory_of_run and record.get("error") is None and all(
                    _is_number(record.get(k)) for k in ("stall_s", "commit_s", "replicate_s")):
                memory.append((float(record["stall_s"]),
                               float(record["commit_s"]) + float(record["replicate_s"])))
            first_memory_of_run = False
        elif kind == Event.recovered:
            if record.get("in_place") is True and _is_number(record.get("failure_to_first_step_s")):
                in_place.append(float(record["failure_to_first_step_s"]))
        elif kind == Event.start:
            first_save_of_run = first_memory_of_run = True
        elif kind == Event.step and _is_number(record.get("step_time_s")):
            step_times.append(float(record["step_time_s"]))
        elif kind == Event.save:
            blocking, latency = record.get("blocking_s"), record.get("commit_latency_s")
            if not (_is_number(blocking) and _is_number(latency)):
                skipped += 1
                continue
            # The loop's wait for the previous save is on the training path too.
            waited = record.get("waited_s", 0.0)
            blocking = float(blocking) + (float(waited) if _is_number(waited) else 0.0)
            saves.append((str(record.get("reason")), blocking, float(latency), first_save_of_run))
            first_save_of_run = False
    if not step_times:
        raise MetricsError(f"{path}: no step events with step_time_s; "
                           "run some training steps first")
    if not saves:
        raise MetricsError(f"{path}: no save events; run training past checkpoint.interval_steps "
                           "(or with a smaller interval) so that it saves at least once")
    pool = [s for s in saves if s[0] == "interval"]
    reason = "interval" if pool else "all"
    pool = pool or saves
    kept = [s for s in pool if not s[3]] or pool
    blocking = statistics.median(s[1] for s in kept)
    latency = statistics.median(s[2] for s in kept)
    return Measured(
        path=str(path),
        step_seconds=statistics.median(step_times),
        step_count=len(step_times),
        blocking_seconds=blocking,
        # Each latency includes its blocking time; keep the model's L >= δ despite clock noise.
        commit_latency_seconds=max(latency, blocking),
        save_count=len(kept),
        save_reason=reason,
        warmup_excluded=len(pool) - len(kept),
        warmup_only=all(s[3] for s in kept),
        latency_raised=latency < blocking,
        skipped_lines=skipped,
        in_place_restart_seconds=statistics.median(in_place) if in_place else None,
        in_place_restart_count=len(in_place),
        memory_blocking_seconds=statistics.median(m[0] for m in memory) if memory else None,
        memory_send_seconds=statistics.median(m[1] for m in memory) if memory else None,
        memory_save_count=len(memory),
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
