"""Where the seconds of a start go: its phases, marked as they end, logged at the first step.

    phases.mark(Phase.model_built)       # in the start path, once per phase
    phases.timeline(previous)            # rank 0, after the first step: the rows to log

The phases and their ``phase`` events: docs/RECOVERY.md, "Where the seconds of a restart
go". Times are wall-clock, so a phase that ended in another process (the previous start's
failure, ``process_started``) counts. ``resume --dry-run`` prints ``breakdown``.
"""

from __future__ import annotations

import enum
import os
import time
from typing import Any

from .metrics import Event, read_events

_IMPORTED_AT = time.time()   # a stand-in for the process start where /proc is missing


class Phase(str, enum.Enum):
    failure_detected = "failure_detected"
    workers_stopped = "workers_stopped"
    process_started = "process_started"
    imports_done = "imports_done"
    rendezvous_done = "rendezvous_done"
    model_built = "model_built"
    checkpoint_chosen = "checkpoint_chosen"
    loaded = "loaded"
    first_step = "first_step"
    checkpoint_process_ready = "checkpoint_process_ready"


ORDER = list(Phase)
_marks: dict[Phase, float] = {}


def mark(phase: Phase, at: float | None = None) -> None:
    """Record that ``phase`` ended now (or at ``at``); the first mark of a phase counts."""
    _marks.setdefault(phase, time.time() if at is None else at)


def process_start_time() -> float:
    """When this process began (Linux: /proc), else when this module was imported."""
    try:
        with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")   # stat(5) field 22
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def timeline(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """This start's phases in order, each with ``at`` and ``duration_s``; ``previous`` (the
    previous start's ``recovery.attempts.cause``) adds its failure and its last rank's end."""
    marks = dict(_marks)
    marks.setdefault(Phase.process_started, process_start_time())
    if previous is not None and previous.get("failed_at"):
        marks[Phase.failure_detected] = previous["failed_at"]
        if previous.get("stopped_at"):
            marks[Phase.workers_stopped] = max(previous["stopped_at"], previous["failed_at"])
    rows, before = [], None
    for phase in [p for p in ORDER if p in marks]:
        at = marks[phase]
        rows.append({"phase": phase.value, "at": round(at, 3),
                     "duration_s": round(at - before, 3) if before is not None else None})
        before = at
    return rows


def newest_timeline(log_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The phase events of the newest start that reached its first step (metrics.jsonl)."""
    events, _ = read_events(log_dir, Event.phase)
    firsts = [e for e in events if e.get("phase") == Phase.first_step.value]
    if not firsts:
        return []
    last = firsts[-1]
    return [e for e in events if e.get("step") == last.get("step")
            and e.get("restart") == last.get("restart") and abs(e["time"] - last["time"]) < 1
            and not e.get("off_the_path")]


def breakdown(rows: list[dict[str, Any]]) -> str:
    """The phases of one start as a few lines of text (``resume --dry-run``, ``plan``)."""
    if not rows:
        return "no start has recorded its phases yet"
    first = rows[0]["at"]
    lines = [f"  {'phase':<26} {'took':>8} {'since ' + rows[0]['phase']:>24}"]
    for row in rows:
        took = "" if row["duration_s"] is None else f"{row['duration_s']:.2f} s"
        lines.append(f"  {row['phase']:<26} {took:>8} {row['at'] - first:>22.2f} s")
    return "\n".join(lines)


def reset() -> None:
    """Forget the marks (a test, or a benchmark that starts the path again in-process)."""
    _marks.clear()
