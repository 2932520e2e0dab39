"""The interruption history: one small record per start, kept with the checkpoints.

    <checkpoint.dir>/history/start-<ms since the epoch>-<id>.json

``read_history`` reads the records back, ``previous_end`` tells how the start before ended,
and rank 0's ``HistorySink`` (a metrics sink) writes its start's record on a thread of its
own, never blocking training. The record's fields (``FORMAT`` 1), when it is written and
why it lives in ``checkpoint.dir``: docs/GOODPUT.md, "The interruption history".
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

from ..checkpoint.store.storage import Storage
from ..runtime import exit_codes
from ..runtime.metrics import Event
from ..runtime.phases import process_start_time

log = logging.getLogger(__name__)

HISTORY_DIR = "history"
FORMAT = 1
HEARTBEAT_S = 60.0     # a running start rewrites its record about this often
END_WAIT_S = 10.0      # the end's write may hold the exit this long at most

# How a start ended (docs/GOODPUT.md, `previous.kind`): these count for the MTBI; the
# other kinds are finished, user_stop (Ctrl-C) and refused (exit 2 or 79).
INTERRUPTIONS = ("preempted_notice", "preempted_no_notice", "crash", "rank_lost", "hang",
                 "node_lost", "storage")
# What recovery/attempts.py calls an end it learned from the ranks' exit records.
FROM_ATTEMPTS = {"lost": "rank_lost", "hang": "hang", "crash": "crash",
                 "killed": "preempted_no_notice"}


def record_name(started_at: float, record_id: str) -> str:
    return f"{HISTORY_DIR}/start-{int(started_at * 1000):015d}-{record_id}.json"


def end_kind(status: int, preempted_status: int) -> str:
    """The kind of an end whose exit status the start decided itself."""
    if status == exit_codes.OK:
        return "finished"
    if status == preempted_status:
        return "preempted_notice"
    return {exit_codes.INTERRUPTED: "user_stop", exit_codes.NOT_SAVED: "storage",
            exit_codes.BAD_INPUT: "refused", exit_codes.NO_PROGRESS: "refused",
            exit_codes.NODE_LOST: "node_lost", exit_codes.HUNG: "hang"}.get(status, "crash")


def read_history(storage: Storage) -> tuple[list[dict[str, Any]], int]:
    """Every readable record, oldest start first, and how many files were skipped."""
    try:
        names = storage.list_files(HISTORY_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return [], 0
    records, skipped = [], 0
    for name in sorted(names):
        if not (name.startswith("start-") and name.endswith(".json")):
            if not (name.endswith(".partial") or name.startswith(".")):
                skipped += 1   # a write in progress, or this directory's .gitignore
            continue
        try:
            record = json.loads(storage.read_text(f"{HISTORY_DIR}/{name}"))
        except (OSError, ValueError, UnicodeDecodeError):
            record = None
        if isinstance(record, dict) and record.get("format") == FORMAT:
            records.append(record)
        else:
            skipped += 1
    records.sort(key=lambda r: float(r.get("started_at", 0.0)))
    return records, skipped


def previous_end(before: dict[str, Any] | None, cause: dict[str, Any] | None,
                 resumed_step: int, preempted_status: int) -> dict[str, Any] | None:
    """How the start before ended: its own end record, else its ranks' exit records
    (``cause``, from log.dir), else "preempted_no_notice"; None for a run's first start."""
    if before is None:
        return None
    end = before.get("end") or {}
    kind, detail = end.get("kind"), end.get("reason", "")
    if cause is not None and cause.get("kind") in FROM_ATTEMPTS and kind in (None, "crash"):
        kind, detail = FROM_ATTEMPTS[cause["kind"]], cause.get("summary", detail)
    elif kind is None and cause is not None and cause.get("status") is not None:
        kind = end_kind(int(cause["status"]), preempted_status)   # its end's write was lost
        detail = cause.get("summary", "")
    if kind is None:
        kind, detail = "preempted_no_notice", "no end was recorded"
    step = end.get("step", before.get("last_step", before.get("resumed_step", 0)))
    if cause is not None and isinstance(cause.get("step"), int):
        step = max(step, cause["step"])
    step = max(int(step), resumed_step) if kind in INTERRUPTIONS else int(step)
    return {"kind": kind, "step": step, "durable_step": resumed_step,
            "steps_lost": max(step - resumed_step, 0),
            "ended_at": end.get("time", before.get("last_seen", before.get("started_at"))),
            "detail": detail}


class HistorySink:
    """Rank 0's writer of this start's record: a metrics sink (``MetricsLog.sinks``)."""

    def __init__(self, storage: Storage, preempted_status: int,
                 cause: dict[str, Any] | None) -> None:
        self.storage = storage
        self.preempted_status = preempted_status
        self.cause = cause   # the start event's cause, from the ranks' exit records
        started_at = process_start_time()
        self.record: dict[str, Any] = {"format": FORMAT, "id": uuid.uuid4().hex[:8],
                                       "started_at": started_at}
        self.name = record_name(started_at, self.record["id"])
        self._before: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._writing: threading.Thread | None = None
        self._dirty = False
        self._warned = False
        self._last_write = 0.0
        try:
            records, _ = read_history(storage)
            self._before = records[-1] if records else None
        except Exception as exc:  # noqa: BLE001 - no history: the record says less
            self._warn(exc)

    def log(self, kind: Event, fields: dict[str, Any]) -> None:
        now = time.time()
        if kind == Event.start:
            resumed = int(fields.get("step") or 0)
            self.record.update(restart=fields.get("restart", 0),
                               world_size=fields.get("world_size"), resumed_step=resumed,
                               resumed_tier=fields.get("resumed_tier"), last_step=resumed,
                               last_seen=now, saves=[],
                               previous=previous_end(self._before, self.cause, resumed,
                                                     self.preempted_status))
            self._write()
        elif kind == Event.phase and fields.get("at") is not None:
            self.record.setdefault("phases", {})[fields["phase"]] = fields["at"]
            if fields["phase"] == "first_step":
                self.record["first_step_at"] = fields["at"]
                self._write()
        elif kind == Event.step:
            self.record.update(last_step=fields.get("step"), last_seen=now)
            if now - self._last_write >= HEARTBEAT_S:
                self._write()
        elif kind == Event.save:
            self.record.setdefault("saves", []).append(fields.get("step"))
            self.record["last_seen"] = now
            self._write()
        elif kind == Event.end:
            status = int(fields.get("status", exit_codes.FAILED))
            self.record["end"] = {"kind": end_kind(status, self.preempted_status),
                                  "step": self.record.get("last_step"), "status": status,
                                  "reason": str(fields.get("reason", "")), "time": now}
            self.record["last_seen"] = now
            self._write()
            self.close()

    def close(self) -> None:
        thread = self._writing
        if thread is not None:
            thread.join(timeout=END_WAIT_S)

    def _write(self) -> None:
        """At most one write in flight; one asked for meanwhile follows with the newest record."""
        self._last_write = time.time()
        with self._lock:
            self._dirty = True
            if self._writing is not None and self._writing.is_alive():
                return
            self._writing = threading.Thread(target=self._drain, name="history-writer", daemon=True)
            self._writing.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._dirty:
                    return
                self._dirty = False
                text = json.dumps(self.record, sort_keys=True)
            try:
                self.storage.makedirs(HISTORY_DIR)
                self.storage.write_text_durable(self.name, text)
            except Exception as exc:  # noqa: BLE001 - the history never stops training
                self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("the interruption history in %s/%s could not be written or read "
                        "(%s: %s); training goes on", self.storage, HISTORY_DIR,
                        type(exc).__name__, exc)
