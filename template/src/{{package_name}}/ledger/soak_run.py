"""The soak's hands: start a job as a launcher does, lay faults on it, restart it.

A job is ``python -m <package>.resume --nproc-per-node R ...`` in a session of its own.
``worker`` SIGKILLs one training worker (torchrun restarts the workers in place), ``term``
SIGTERMs the job (a preemption with notice: exit 75), ``kill`` SIGKILLs its whole tree (a
machine lost); a fault that finds no job running is counted as missed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import PACKAGE
from ..runtime import exit_codes
from ..runtime.process_tree import kill_tree, process_tree

FAULT_KINDS = ("worker", "term", "kill")
QUEUE_S = 0.5          # the launcher's pause before it starts the job again
POLL_S = 0.05


@dataclass(frozen=True)
class Fault:
    at_s: float      # seconds from the run's start
    kind: str        # one of FAULT_KINDS


def start_job(ranks: int, overrides: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "a", encoding="utf-8") as out:
        return subprocess.Popen(
            [sys.executable, "-m", f"{PACKAGE}.resume", "--nproc-per-node", str(ranks),
             *overrides], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)


def wait_job(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise SoakRunError(f"a job ran longer than {timeout_s:g} s and was killed") from None


class SoakRunError(RuntimeError):
    pass


def _workers(job: int) -> list[int]:
    """The job's training workers: torchrun gives each a RANK (its own agent, whose
    command line names the training module too, has none)."""
    found = []
    for pid in process_tree(job):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (f"{PACKAGE}.train".encode() in command
                and any(item.startswith(b"RANK=") for item in environ)):
            found.append(pid)
    return found


def _hit(proc: subprocess.Popen, fault: Fault, rng: random.Random) -> bool:
    """Lay one fault on the running job; False when there was nothing to hit."""
    if fault.kind == "term":
        proc.send_signal(signal.SIGTERM)
        return True
    if fault.kind == "kill":
        kill_tree(proc.pid)
        return True
    workers = _workers(proc.pid)
    if not workers:
        return False            # the workers are not up yet (or gone)
    try:
        os.kill(rng.choice(sorted(workers)), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def run_with_faults(ranks: int, overrides: list[str], log: Path, faults: list[Fault],
                    seed: int, deadline_s: float) -> dict:
    """Run the job to its end under ``faults``, restarting it after every stop; returns
    what was laid on it: {"hit": {kind: n}, "missed": n, "jobs": n, "statuses": [...]}."""
    rng = random.Random(seed + 1)
    began = time.monotonic()
    pending = sorted(faults, key=lambda f: f.at_s)
    hit = dict.fromkeys(FAULT_KINDS, 0)
    missed, statuses = 0, []
    while True:
        proc = start_job(ranks, overrides, log)
        while proc.poll() is None:
            now = time.monotonic() - began
            if now > deadline_s:
                kill_tree(proc.pid)
                proc.wait()
                raise SoakRunError(f"the run did not finish within {deadline_s:.0f} s")
            while pending and pending[0].at_s <= now:
                fault = pending.pop(0)
                if proc.poll() is None and _hit(proc, fault, rng):
                    hit[fault.kind] += 1
                else:
                    missed += 1
            time.sleep(POLL_S)
        statuses.append(proc.returncode)
        if proc.returncode == exit_codes.OK:
            return {"hit": hit, "missed": missed, "jobs": len(statuses), "statuses": statuses}
        if proc.returncode in (exit_codes.BAD_INPUT, exit_codes.NO_PROGRESS):
            raise SoakRunError(f"the job refused to run on (exit {proc.returncode}; see {log})")
        time.sleep(QUEUE_S)
        now = time.monotonic() - began
        while pending and pending[0].at_s <= now:   # no job to hit in the queue
            pending.pop(0)
            missed += 1
