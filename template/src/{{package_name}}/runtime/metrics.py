"""Progress for people (a line every few steps) and for tools (metrics.jsonl).

``<log.dir>/metrics.jsonl``: the event names, rank 0's writer (one JSON object per line)
and the readers every command uses, which skip a line cut short by a kill.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .output_dirs import make_output_dir

METRICS_FILE = "metrics.jsonl"


class Event(str, enum.Enum):
    """The kinds of line in metrics.jsonl (the ``event`` field)."""

    start = "start"                          # a training process group started (or resumed)
    step = "step"                            # one optimizer step: loss, metrics, timings
    eval = "eval"                            # an evaluation on held-out data: eval_loss, ...
    save = "save"                            # a checkpoint committed
    save_mode_changed = "save_mode_changed"  # saves fell back to synchronous
    preemption = "preemption"                # a stop request was handled
    end = "end"                              # the run's exit status and why (rank 0)
    recovered = "recovered"                  # the first step after a start that followed a failure
    memory_save = "memory_save"              # a memory copy committed (and sent to the partner)
    phase = "phase"                          # one phase of a start and its seconds (runtime/phases.py)
    hang = "hang"                            # a rank's watchdog fired (written by that rank)
    straggler = "straggler"                  # a rank slower than the others (rank 0)


def metrics_file(log_dir_or_file: str | os.PathLike) -> Path:
    """The metrics file of a log directory (a path to the file itself is kept)."""
    path = Path(log_dir_or_file)
    return path if path.name == METRICS_FILE or path.is_file() else path / METRICS_FILE


def parse_line(line: str | bytes) -> dict[str, Any] | None:
    """One event, or None for a blank line, a torn line or anything not an event."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def read_events(log_dir_or_file: str | os.PathLike, *kinds: Event | str,
                since: float | None = None) -> tuple[list[dict[str, Any]], int]:
    """The events of the given kinds (default all) logged at or after ``since``, in file
    order, and the count of unreadable lines."""
    path = metrics_file(log_dir_or_file)
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return [], 0
    wanted = {Event(kind).value for kind in kinds}
    events, unreadable = [], 0
    for line in lines:
        if not line.strip():
            continue
        event = parse_line(line)
        if event is None:
            unreadable += 1
        elif (not wanted or event["event"] in wanted) and (
                since is None or event.get("time", 0) >= since):
            events.append(event)
    return events, unreadable


class EventTail:
    """Reads the events appended to a metrics file since the last call (whole lines only)."""

    def __init__(self, log_dir_or_file: str | os.PathLike) -> None:
        self.path = metrics_file(log_dir_or_file)
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [e for e in map(parse_line, data[:end].splitlines()) if e is not None]


def append_event(log_dir: str | os.PathLike, kind: Event, **fields: Any) -> None:
    """Append one event from any rank in one write, never interleaved with rank 0's lines."""
    make_output_dir(log_dir)   # ignored by git when made here (output_dirs.py)
    record = {"event": Event(kind).value, **fields, "time": time.time()}
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(Path(log_dir) / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class MetricsLog:
    """Rank 0 appends one JSON object per line; other ranks get a silent instance."""

    def __init__(self, log_dir: str | None, stream: TextIO = sys.stdout) -> None:
        self.enabled = log_dir is not None
        self.stream = stream
        self._file = None
        self.sinks: list[Any] = []   # experiment trackers: each gets every event (tracking/)
        if log_dir is not None:
            make_output_dir(log_dir)   # ignored by git when made here (output_dirs.py)
            self.path = Path(log_dir) / METRICS_FILE
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the whole run

    def event(self, kind: Event, **fields: Any) -> None:
        if self._file is not None:
            record = {"event": Event(kind).value, **fields, "time": time.time()}
            self._file.write(json.dumps(record) + "\n")
            for sink in self.sinks:
                sink.log(Event(kind), fields)

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self._file is not None:
            self._file.close()
            self._file = None
