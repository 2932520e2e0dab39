"""How each start of training ended, rank by rank, and what the next start learns from it.

    <log.dir>/exits/rank<R>.json   {"rank", "host", "pid", "run_id", "restart", "started",
                                    "state", "status", "step", "reason", "time"}

``state``: ``running`` from the start, then ``ended``, ``crashed`` or ``hung``; a rank
killed by a signal or a fatal error leaves ``running``. The next start gathers the
previous one's records; rank 0 logs the cause in its ``start`` event (docs/RECOVERY.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..runtime.exit_codes import HUNG, error_line
from ..runtime.output_dirs import make_output_dir

EXITS_DIR = "exits"
ONE_START_S = 600.0  # the ranks of one start begin within this of each other
# Which record names the cause, first to last (a silent death explains the others' errors).
_PRIORITY = {"running": 0, "hung": 1, "crashed": 2, "ended": 3}
KIND = {"running": "lost", "hung": "hang", "crashed": "crash", "ended": "exit"}
# Ends that count as failures of the job; not "killed" (every rank ended without a word: a
# kill from outside, as a preemption without notice) nor "exit" (a status training decided).
FAILURES = ("lost", "hang", "crash")


def signal_of(status: int | None) -> str | None:
    """The signal a shell-style status 128+N stands for (130: SIGINT), else None."""
    if status is None or not 128 < status < 128 + signal.NSIG:
        return None
    try:
        return signal.Signals(status - 128).name
    except ValueError:
        return None


class Attempt:
    """This process's start: who it is, under which torchrun restart, and its record."""

    def __init__(self, log_dir: str | os.PathLike, rank: int) -> None:
        self.dir = Path(log_dir) / EXITS_DIR
        self.rank = rank
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        # The job's count, the highest of every rank's (job.py, after the rendezvous): a
        # replacement node's torchrun counts from 0, and global rank 0 may be on it.
        self.job_restart = self.restart
        self.max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self.started = time.time()
        self.progress: Any = None      # the trainer's Progress, once there is one: its step
        self._record = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                        "run_id": self.run_id, "restart": self.restart,
                        "started": self.started}

    @property
    def step(self) -> int | None:
        """The newest step this rank finished, while training."""
        return getattr(self.progress, "step", None)

    @property
    def in_place(self) -> bool:
        """Whether torchrun restarted the workers in place, on any node, for this start."""
        return self.job_restart > 0

    @property
    def restarts_left(self) -> int:
        """How many more times torchrun would restart the workers in place."""
        return max(0, self.max_restarts - self.restart)

    @property
    def path(self) -> Path:
        return self.dir / f"rank{self.rank}.json"

    def _write(self, state: str, **fields: Any) -> None:
        record = {**self._record, "state": state, "step": self.step, **fields,
                  "time": time.time()}
        try:
            make_output_dir(self.dir.parent)   # log.dir: ignored by git when made here
            self.dir.mkdir(exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full or read-only log.dir costs the next start its cause, nothing more

    def begin(self, **fields: Any) -> None:
        """This rank is running (``fields``: e.g. rank 0's ``newest_step`` at this start)."""
        self._record.update(fields)
        self._write("running")

    def ended(self, status: int, reason: str) -> None:
        self._write("ended", status=status, reason=reason)

    def crashed(self, exc: BaseException) -> None:
        self._write("crashed", status=1, reason=error_line(exc))

    def hung(self, waited_s: float, bound_s: float) -> None:
        self._write("hung", status=HUNG, reason=f"no step finished in {waited_s:.1f} s "
                    f"(bound {bound_s:.1f} s)")


def read_records(log_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every rank's record in ``<log_dir>/exits`` (this node's, or all when log.dir is shared)."""
    records = []
    for path in sorted((Path(log_dir) / EXITS_DIR).glob("rank*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # cut short by a kill while written: nothing to learn from it
        if isinstance(record, dict) and record.get("state") in _PRIORITY:
            records.append(record)
    return records


def gather_previous(attempt: Attempt, world_size: int) -> list[dict[str, Any]]:
    """Every rank's records of the previous start (a collective, before ``attempt.begin()``)."""
    mine = read_records(attempt.dir.parent)   # this node's (all ranks', if log.dir is shared)
    if world_size > 1:
        every: list = [None] * world_size
        dist.all_gather_object(every, mine)
        mine = [record for records in every for record in records]
    unique = {(r.get("host"), r.get("pid")): r for r in mine}
    if not unique:
        return []
    newest = max(unique.values(), key=lambda r: r.get("started", 0))
    key = (newest.get("run_id"), newest.get("restart"))
    # The ranks of one start meet within the rendezvous; an older job's records may share
    # its run id and restart count (a fixed --rdzv-id), never its start time.
    same = [r for r in unique.values() if (r.get("run_id"), r.get("restart")) == key
            and newest.get("started", 0) - r.get("started", 0) < ONE_START_S]
    return sorted(same, key=lambda r: r.get("rank", 0))


def describe(record: dict[str, Any]) -> str:
    """One rank's end in a few words."""
    state, rank = record["state"], record.get("rank")
    at = f" at step {record['step']}" if record.get("step") is not None else ""
    if state == "running":
        return (f"rank {rank} ended without a word{at} (killed by a signal such as SIGKILL "
                "or the out-of-memory killer, or a fatal error: see its output)")
    if state == "hung":
        return f"rank {rank}'s watchdog fired{at}: {record.get('reason', '')}"
    if state == "crashed":
        return f"rank {rank} crashed{at}: {record.get('reason', '')}"
    return f"rank {rank} exited {record.get('status')}{at}: {record.get('reason', '')}"


def cause(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The cause of the previous end from its ranks' records (None: none known). ``kind``:
    ``lost`` (one rank died without a word), ``killed`` (all did), ``hang``, ``crash`` or
    ``exit``; ``failed_at``: when the failure was first recorded (None: unknown, or exit)."""
    if not records:
        return None
    primary = min(records, key=lambda r: (_PRIORITY[r["state"]], r.get("time", 0)))
    silent = primary["state"] == "running"   # ended without a word: its record says no more
    kind = "killed" if all(r["state"] == "running" for r in records) else KIND[primary["state"]]
    status = None if silent else primary.get("status")
    ended = [r["time"] for r in records if r["state"] != "running" and "time" in r]
    others = [describe(r) for r in records if r is not primary]
    failed_at = None if silent or kind not in FAILURES else primary.get("time")
    if failed_at is None and kind in FAILURES and ended:
        failed_at = min(ended)
    return {
        "kind": kind,
        "rank": primary.get("rank"),
        "step": primary.get("step"),
        "status": status,
        "signal": signal_of(status),
        "error": None if silent else primary.get("reason"),
        "failed_at": failed_at,
        "stopped_at": max(ended) if ended else None,   # the last recorded end of a rank
        "restart": primary.get("restart"),
        "newest_step": next((r["newest_step"] for r in records if "newest_step" in r), None),
        "attempt": "{}/{}/{:.3f}".format(primary.get("run_id"), primary.get("restart"),
                                         min(r.get("started", 0) for r in records)),
        "summary": ("every rank ended without a word (the machine or the whole job was "
                    "killed from outside, or lost)" if kind == "killed"
                    else "; ".join([describe(primary), *others])),
        "ranks": [{"rank": r.get("rank"), "state": r["state"], "status": r.get("status"),
                   "step": r.get("step"), "reason": r.get("reason")} for r in records],
    }
