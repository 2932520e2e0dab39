"""How a launch of torchrun ended, as ``resume``'s exit status (launch/supervisor.py).

torchrun exits 1 after any signal, even a clean stop, and for any failed worker: the
verdict is read from the run's log, its exit records and the checkpoints.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from ..checkpoint import Committed, newest_complete_checkpoint
from ..checkpoint.store.storage import Storage
from ..config import PreemptionConfig, RecoveryConfig
from ..recovery.attempts import describe, read_records
from ..runtime import exit_codes
from ..runtime.metrics import Event, read_events


def say(line: str) -> None:
    print(f"resume: {line}", file=sys.stderr, flush=True)


def stopped_before_launch(sig: signal.Signals, preemption: PreemptionConfig) -> int:
    """A signal came before torchrun was started: nothing has trained, nothing is lost."""
    status = (exit_codes.INTERRUPTED if sig == signal.SIGINT
              else preemption.exit_code if sig.name in preemption.signals else 128 + sig)
    say(f"{sig.name} arrived before training was launched: nothing new to save, the newest "
        f"committed checkpoint is unchanged; exit {status}"
        + (": run resume again" if status == preemption.exit_code else ""))
    return status


def preemption_logged_since(log_dir: Path, since: float) -> bool:
    """Whether training logged a preemption stop after ``since`` (even one that saved nothing)."""
    return bool(read_events(log_dir, Event.preemption, since=since)[0])


def training_status_since(log_dir: Path, since: float) -> tuple[int, str] | None:
    """The status and reason of the last ``end`` event training logged after ``since``."""
    ends = read_events(log_dir, Event.end, since=since)[0]
    return (int(ends[-1]["status"]), str(ends[-1].get("reason", ""))) if ends else None


def node_lost_since(log_dir: Path, since: float, recovery: RecoveryConfig) -> str | None:
    """Why torchrun gave up on a node of several, or None: this launch's newest start (its
    exit records) failed with restarts left, and no later start followed."""
    if not (records := [r for r in read_records(log_dir) if r.get("started", 0) >= since]):
        return None  # no start in this launch: the first meeting failed, torchrun's status
    restart = max(int(r.get("restart", 0)) for r in records)
    last = [r for r in records if int(r.get("restart", 0)) == restart]
    failed = [r for r in last if r["state"] in ("crashed", "hung", "running")]
    if not failed or any(r["state"] == "ended" for r in last):
        return None
    if restart >= recovery.max_restarts:
        return None  # the in-place restarts were used up: a crash, torchrun's status
    first = min(failed, key=lambda r: r.get("time", 0))
    return (f"{describe(first)}; then torchrun could not gather every node for its restart "
            f"{restart + 1} of {recovery.max_restarts}: the rendezvous waits up to "
            f"recovery.rendezvous_timeout_s={recovery.rendezvous_timeout_s:g} s, and fails at "
            "once when the node hosting it is gone")


def exit_status(returncode: int, storage: Storage, before: Committed | None,
                preemption: PreemptionConfig, forwarded: list[str],
                stopped_by_notice: bool = False,
                training_status: tuple[int, str] | None = None,
                node_lost: str | None = None, memory_tier: bool = False) -> int:
    """0, a status training logged (``exit_codes.FINAL``), ``preemption.exit_code`` (a
    preemption checkpoint committed, a signal forwarded, or a stop logged during this
    launch), ``NODE_LOST``, else torchrun's."""
    if returncode == 0:
        return 0
    if training_status is not None and training_status[0] in exit_codes.FINAL:
        status, reason = training_status
        say(f"training ended with exit status {status}: {reason}")
        return status
    try:
        after = newest_complete_checkpoint(storage, verify="none")  # sizes: quick, in the grace
    except Exception as exc:  # noqa: BLE001 - the store down now: judge by the signals alone
        say(f"cannot list {storage} to see the final checkpoint "
            f"({exit_codes.error_line(exc, 160)})")
        after = None
    new_preemption_save = (after is not None and after.record.get("reason") == "preemption"
                           and (before is None or (after.name, after.record)
                                != (before.name, before.record)))
    signalled = [name for name in forwarded if name in preemption.signals]
    if new_preemption_save or signalled or stopped_by_notice:
        why = (f"checkpoint step {after.step} committed on preemption" if new_preemption_save
               else f"{signalled[0]} received" if signalled
               else "training logged a preemption stop")
        say(f"preempted ({why}); exit {preemption.exit_code}: run resume again")
        return preemption.exit_code
    if node_lost is not None:
        durable = f"committed checkpoint{f' (step {after.step})' if after else ''}"
        say(f"a node of this job was lost ({node_lost}); exit {exit_codes.NODE_LOST}: run "
            "again, training resumes from the newest "
            + (f"memory copy every rank can still reach, or else the newest {durable} "
               "(a copy held on the lost node comes from its partner node's)"
               if memory_tier else durable))
        return exit_codes.NODE_LOST
    # A negative status means torchrun died of a signal; report it the way shells do.
    return 128 - returncode if returncode < 0 else returncode
