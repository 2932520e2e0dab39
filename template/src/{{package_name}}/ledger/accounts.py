"""The goodput ledger: where the wall-clock time of a run went, over every start.

Every second from the first start's process start to the run's last event falls in one of
``PARTS``, which add up to the wall time (docs/GOODPUT.md, "The ledger"). With metrics.jsonl
each step is placed by its own event; from the history alone (coarse) a start's training
is split into productive and rework by its steps, and its restart is its first-step time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runtime.metrics import Event
from .history import INTERRUPTIONS

PARTS = ("productive", "rework", "saving", "eval", "restart", "unaccounted")
RESTART_PHASES = ("detection", "queue", "imports", "rendezvous", "build", "load", "first_step")
# runtime/phases.py's phase -> the ledger's restart phase
PHASE_OF = {"imports_done": "imports", "rendezvous_done": "rendezvous",
            "model_built": "build", "checkpoint_chosen": "load", "loaded": "load",
            "first_step": "first_step"}


@dataclass
class Start:
    record: dict[str, Any]                       # its history record ({} when none)
    events: list[dict[str, Any]] = field(default_factory=list)   # its metrics events

    @property
    def phases(self) -> dict[str, float]:
        return {e["phase"]: e["at"] for e in self.events if e["event"] == Event.phase
                and e.get("at") is not None}

    @property
    def started_at(self) -> float:
        if (process_started := self.phases.get("process_started")) is not None:
            return float(process_started)
        if self.record.get("started_at") is not None:
            return float(self.record["started_at"])
        return float(self.events[0]["time"])

    @property
    def last_time(self) -> float:
        times = [e["time"] for e in self.events]
        end = self.record.get("end") or {}
        times += [t for t in (self.record.get("last_seen"), end.get("time")) if t is not None]
        return float(max(times)) if times else self.started_at


@dataclass
class Ledger:
    wall_s: float
    parts_s: dict[str, float]
    restart_phases_s: dict[str, float]
    interruptions: list[dict[str, Any]]
    starts: list[dict[str, Any]]   # per start, for the plot: its spans in wall time
    coarse: bool                   # from the history alone

    @property
    def badput_percent(self) -> float:
        bad = self.wall_s - self.parts_s["productive"]
        return 100.0 * bad / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def exposure_s(self) -> float:
        """The MTBI's exposure: each start's process start to its last sign of life, summed."""
        return sum(max(s["end"] - s["begin"], 0.0) for s in self.starts)


def split_starts(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[Start]:
    """Pair the history's records with the metrics' starts (a ``start`` event each)."""
    segments: list[list[dict[str, Any]]] = []
    for event in events:   # in the file's order: each start's events follow its start event
        if event["event"] == Event.start or not segments:
            segments.append([])
        segments[-1].append(event)
    starts, unused = [], list(records)
    for segment in segments:
        begin = segment[0]["time"]
        # the record of the process that logged this start: it began just before
        before = [r for r in unused if float(r.get("started_at", 0)) <= begin + 1.0]
        record = max(before, key=lambda r: r["started_at"]) if before else {}
        if record:
            unused.remove(record)
        starts.append(Start(record, segment))
    starts += [Start(r) for r in unused]          # starts with no metrics (log.dir lost)
    starts.sort(key=lambda s: s.started_at)
    return starts


def account(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> Ledger:
    starts = split_starts(records, events)
    if not starts:
        raise ValueError("no start of training is recorded: nothing to account for")
    parts = dict.fromkeys(PARTS, 0.0)
    phases = dict.fromkeys(RESTART_PHASES, 0.0)
    furthest = 0            # the furthest step reached by any earlier start
    spans, interruptions = [], []
    coarse = not any(s.events for s in starts)
    previous_end: float | None = None
    reached: int | None = None   # the last step of the start before, as its events say
    for start in starts:
        begin, end = start.started_at, start.last_time
        if previous_end is not None:
            detection, queue = _gap(start, previous_end, begin)
            phases["detection"] += detection
            phases["queue"] += queue
        span = {"begin": begin, "end": end, "steps": [], "saves": [], "evals": [],
                "phases": {}, "record": start.record.get("id")}
        furthest = (_account_events(start, parts, phases, span, furthest) if start.events
                    else _account_record(start.record, parts, phases, span, furthest))
        previous = start.record.get("previous")
        if previous and previous.get("kind") in INTERRUPTIONS:
            interruptions.append(_interruption(start, previous, previous_end, reached))
        spans.append(span)
        previous_end = end
        reached = _last_step(start, reached)
    wall = starts[-1].last_time - starts[0].started_at
    parts["restart"] = sum(phases.values())
    parts["unaccounted"] = wall - sum(v for k, v in parts.items() if k != "unaccounted")
    return Ledger(wall, parts, phases, interruptions, spans, coarse)


def _last_step(start: Start, before: int | None) -> int | None:
    steps = [e["step"] for e in start.events if e["event"] == Event.step
             and isinstance(e.get("step"), int)]
    return max(steps) if steps else start.record.get("last_step", before)


def _interruption(start: Start, previous: dict[str, Any], previous_end: float | None,
                  reached: int | None) -> dict[str, Any]:
    """The interruption this start followed: its record's ``previous``, made more exact by
    the start before's own events (when and where) if log.dir has them."""
    ended = previous.get("ended_at")
    if previous_end is not None and (ended is None or previous_end > ended):
        ended = previous_end
    step = previous.get("step")
    if reached is not None and (step is None or reached > step):
        step = reached
    resumed = start.record.get("resumed_step", previous.get("durable_step"))
    lost = max(step - resumed, 0) if step is not None and resumed is not None else \
        previous.get("steps_lost")
    first = start.record.get("first_step_at")
    return {"time": ended, "kind": previous["kind"], "step": step, "steps_lost": lost,
            "downtime_s": first - ended if first is not None and ended is not None else None,
            "in_place": int(start.record.get("restart") or 0) > 0,   # torchrun restarted it
            "detail": previous.get("detail", "")}


def _gap(start: Start, previous_end: float, begin: float) -> tuple[float, float]:
    """The gap since the previous start's last sign of life, as (detection: until every
    rank had stopped, from the phase events; queue: the rest)."""
    gap = max(begin - previous_end, 0.0)
    stopped = start.phases.get("workers_stopped")
    detection = min(max(stopped - previous_end, 0.0), gap) if stopped is not None else 0.0
    return detection, gap - detection


def _account_events(start: Start, parts: dict[str, float], phases: dict[str, float],
                    span: dict[str, Any], furthest: int) -> int:
    """One start from its metrics events; returns the furthest step reached so far."""
    events = start.events
    steps = [e for e in events if e["event"] == Event.step and isinstance(e.get("step"), int)]
    marks = [(e["phase"], e["at"]) for e in events if e["event"] == Event.phase
             and e.get("at") is not None and e["phase"] in PHASE_OF]
    begin = last = start.started_at
    for phase, at in sorted(marks, key=lambda m: m[1]):
        seconds = max(at - last, 0.0)
        phases[PHASE_OF[phase]] += seconds
        span["phases"][PHASE_OF[phase]] = span["phases"].get(PHASE_OF[phase], 0.0) + seconds
        last = max(last, at)
    if not steps:
        return furthest
    first_step_at = max(last, begin) if marks else steps[0]["time"]
    if not marks:   # no phase events: the time to the first step is the restart's
        phases["first_step"] += max(steps[0]["time"] - begin, 0.0)
    # step -> seconds the loop was blocked at it by the save path: each save's stall and
    # wait, then the first save's wait for the checkpoint process to be up
    ready = [e for e in events if e["event"] == Event.phase
             and e.get("phase") == "checkpoint_process_ready"]
    blocking: dict[Any, float] = {}
    for e in [e for e in events if e["event"] == Event.save] + ready:
        blocking[e.get("step")] = blocking.get(e.get("step"), 0.0) + float(
            e.get("blocking_s") or 0.0) + float(e.get("waited_s") or 0.0)
    evals = [e for e in events if e["event"] == Event.eval]
    previous_time, previous_step = first_step_at, steps[0]["step"]
    reached = furthest
    for event in steps[1:]:
        dt = max(event["time"] - previous_time, 0.0)
        saving = min(blocking.pop(previous_step, 0.0), dt)
        evaluating = min(sum(float(e.get("eval_time_s") or 0.0) for e in evals
                             if previous_time < e["time"] <= event["time"]), dt - saving)
        work = dt - saving - evaluating
        parts["saving"] += saving
        parts["eval"] += evaluating
        if saving:
            span["saves"].append((previous_time, previous_time + saving))
        part = "productive" if event["step"] > reached else "rework"
        parts[part] += work
        span["steps"].append((event["time"] - work, event["time"], part))
        reached = max(reached, event["step"])
        previous_time, previous_step = event["time"], event["step"]
    # After the last step: the final save, a last evaluation; the rest is unaccounted.
    tail_saving = sum(blocking.values())
    tail_eval = sum(float(e.get("eval_time_s") or 0.0) for e in evals if e["time"] > previous_time)
    room = max(start.last_time - previous_time, 0.0)
    parts["saving"] += min(tail_saving, room)
    parts["eval"] += min(tail_eval, max(room - tail_saving, 0.0))
    if tail_saving:
        span["saves"].append((previous_time, previous_time + min(tail_saving, room)))
    span["evals"] = [(e["time"] - float(e.get("eval_time_s") or 0.0), e["time"]) for e in evals]
    return max(reached, max(e["step"] for e in steps))


def _account_record(record: dict[str, Any], parts: dict[str, float], phases: dict[str, float],
                    span: dict[str, Any], furthest: int) -> int:
    """One start from its history record alone (coarse); returns the furthest step."""
    begin = float(record.get("started_at", 0.0))
    first = record.get("first_step_at")
    end = float((record.get("end") or {}).get("time") or record.get("last_seen") or begin)
    if first is None:
        phases["first_step"] += max(end - begin, 0.0)
        return furthest
    phases["first_step"] += max(first - begin, 0.0)
    resumed, last = int(record.get("resumed_step") or 0), int(record.get("last_step") or 0)
    training = max(end - first, 0.0)
    steps = max(last - resumed - 1, 0)      # the first step is counted in the restart
    redone = min(max(furthest - resumed - 1, 0), steps)
    per_step = training / steps if steps else 0.0
    parts["rework"] += redone * per_step
    parts["productive"] += training - redone * per_step
    span["steps"].append((first, end, "training"))
    return max(furthest, last)
