"""One writer per checkpoint directory: a lease held by the job that trains into it.

    <root>/lease.json   {"host", "pid", "job_id", "acquired", "heartbeat"}

Rank 0 takes it before anything is built and renews it from a thread; a job whose lease
was taken over stops committing (its saves fail, saying why). Who waits, who refuses, which
leases are taken over, and two jobs on an object store (no compare-and-swap: written, then
read back at each renewal): docs/PREEMPTION.md, "One job per checkpoint directory".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from ...runtime.exit_codes import error_line
from ...runtime.process_tree import alive
from .storage import Storage

log = logging.getLogger(__name__)

LEASE_FILE = "lease.json"
# The job's id as its scheduler names it, the same on every node and on every run of the
# job (TORCHELASTIC_RUN_ID is resume's --rdzv-id); the first one set counts.
SCHEDULER_JOB_ID_VARIABLES = ("SLURM_JOB_ID", "SKYPILOT_TASK_ID", "JOB_ID")
JOB_ID_VARIABLES = (*SCHEDULER_JOB_ID_VARIABLES, "TORCHELASTIC_RUN_ID")
POLL_S = 1.0


class LeaseHeld(RuntimeError):
    """Another live job holds the checkpoint directory; the message names it."""


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    job_id: str
    acquired: float
    heartbeat: float

    def describe(self, now: float) -> str:
        return (f"job {self.job_id} (host {self.host}, pid {self.pid}, last heartbeat "
                f"{now - self.heartbeat:.0f} s ago)")


def this_job_id() -> str:
    value = next((os.environ[name] for name in JOB_ID_VARIABLES
                  if os.environ.get(name, "") not in ("", "none")), None)
    return value or f"{socket.gethostname()}:{os.getppid()}"


def scheduler_job_id() -> str | None:
    """The scheduler's id of this job, or None outside a scheduler."""
    return next((os.environ[name] for name in SCHEDULER_JOB_ID_VARIABLES
                 if os.environ.get(name, "") not in ("", "none")), None)


class Lease:
    def __init__(self, storage: Storage, *, stale_s: float, wait_s: float) -> None:
        self.storage, self.stale_s, self.wait_s = storage, stale_s, wait_s
        self.me = Owner(socket.gethostname(), os.getpid(), this_job_id(), time.time(),
                        time.time())
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def owner(self) -> Owner | None:
        """The current holder, or None when there is none (or the file is unreadable)."""
        try:
            return Owner(**json.loads(self.storage.read_text(LEASE_FILE)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            log.warning("lease file %s is unreadable (%s): taking it over",
                        self.storage.path(LEASE_FILE), exc)
            return None

    def _is_me(self, owner: Owner) -> bool:
        return (owner.host, owner.pid, owner.job_id) == (self.me.host, self.me.pid,
                                                          self.me.job_id)

    def _gone(self, owner: Owner, now: float) -> str | None:
        """Why ``owner`` no longer holds the lease, or None when it is live."""
        if now - owner.heartbeat > self.stale_s:
            return f"no heartbeat for {now - owner.heartbeat:.0f} s"
        if owner.host == self.me.host and not alive(owner.pid):
            return f"process {owner.pid} on this host has ended"
        if (job := scheduler_job_id()) is not None and owner.job_id == job:
            return f"an earlier run of this job ({job}), which has ended"
        return None

    def acquire(self, *, take: bool = True) -> str | None:
        """Take the lease, waiting up to ``wait_s`` for a live holder (then LeaseHeld); a
        notice when one was taken over, else None. ``take=False`` only waits until it could
        be taken (``resume`` checks before starting torchrun)."""
        if take:
            self.storage.makedirs()
        deadline = time.monotonic() + self.wait_s
        waited = False
        while True:
            now = time.time()
            owner = self.owner()
            gone = self._gone(owner, now) if owner is not None else None
            if owner is None or self._is_me(owner) or gone is not None:
                if take:
                    self._write(now)
                if owner is None or self._is_me(owner):
                    return None
                notice = f"took over the lease of {owner.describe(now)}: {gone}"
                log.warning("checkpoint.dir %s: %s", self.storage, notice)
                return notice
            if time.monotonic() >= deadline:
                raise LeaseHeld(
                    f"checkpoint.dir {self.storage} is in use by {owner.describe(now)}; "
                    f"two jobs must not write one checkpoint directory. Stop that job, or "
                    f"wait until it has ended (a lease without a heartbeat for "
                    f"checkpoint.lease_stale_s={self.stale_s:g} s is taken over), or use "
                    "another checkpoint.dir")
            if not waited:
                log.warning("checkpoint.dir %s is held by %s: waiting up to %g s for it to "
                            "be released", self.storage, owner.describe(now), self.wait_s)
                waited = True
            time.sleep(POLL_S)

    def _write(self, now: float) -> None:
        mine = Owner(self.me.host, self.me.pid, self.me.job_id, self.me.acquired, now)
        self.storage.write_text_durable(LEASE_FILE, json.dumps(asdict(mine)))
        self.held = True

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        interval = max(0.5, self.stale_s / 4)
        renewed = time.time()
        while not self._stop.wait(interval):
            try:
                if (owner := self.owner()) is not None and not self._is_me(owner):
                    self.held = False
                    log.error("checkpoint.dir %s was taken over by %s: no checkpoint of this "
                              "job will commit there any more", self.storage,
                              owner.describe(time.time()))
                    return
                self._write(time.time())
                renewed = time.time()
            except Exception as exc:  # noqa: BLE001 - any failure: the next beat tries again
                log.warning("could not renew the lease on %s: %s: %s", self.storage,
                            type(exc).__name__, exc)
                if self.held and time.time() - renewed > self.stale_s:
                    # Another job may take a lease this stale: stop committing to be safe.
                    self.held = False
                    log.error("the lease on %s was not renewed for %g s (checkpoint."
                              "lease_stale_s): no checkpoint of this job will commit there "
                              "any more", self.storage, self.stale_s)

    def release_for_ended_job(self, job_id: str) -> str | None:
        """Remove ``job_id``'s lease, the caller knowing that job ended on every node (one still
        running rewrites it at its next beat); the holder in words, or None if not held."""
        if (owner := self.owner()) is None or owner.job_id != job_id:
            return None
        self.storage.remove_file(LEASE_FILE)
        return owner.describe(time.time())

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.held:
            return
        self.held = False
        try:
            if (owner := self.owner()) is not None and self._is_me(owner):
                self.storage.remove_file(LEASE_FILE)
        except Exception as exc:  # noqa: BLE001 - any store error (botocore's are not OSErrors)
            # The run's own outcome stands; the lease goes stale in lease_stale_s.
            log.warning("could not release the lease on %s: %s", self.storage,
                        error_line(exc, 200))
