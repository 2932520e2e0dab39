"""The exit statuses of every command, defined once (docs/PREEMPTION.md and
docs/RECOVERY.md explain them).

A scheduler reads these: 0, ``BAD_INPUT`` and ``NO_PROGRESS`` end the job;
``preemption.exit_code`` (``PREEMPTED``, 75 by default), ``NOT_SAVED`` and ``NODE_LOST`` ask
for another run, which resumes from the newest committed checkpoint. ``HUNG`` is a worker's
own status when its watchdog fires: torchrun restarts the workers in place on it, and a
launcher never sees it (``resume`` reports torchrun's).

A command refuses one way: it raises ``Refused`` (one sentence, and its status), and
``refusals`` around its ``main`` turns that into the line ``error: <sentence>`` on stderr
and the status, without a traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

OK = 0             # finished (train, resume), passed (drill, verify)
FAILED = 1         # crashed, or a check failed (drill, verify)
BAD_INPUT = 2      # refused before running: configuration, arguments, a task breaking its contract
NOT_SAVED = 73     # training ended but its last state is not in a committed checkpoint: run again
NODE_LOST = 74     # several nodes: one was lost (it vanished, or did not come back within
                   # recovery.rendezvous_timeout_s); the others stopped. Run again: training
                   # resumes from the newest committed checkpoint, or a newer memory copy
                   # (checkpoint.memory_interval_steps; resume says which may be used)
PREEMPTED = 75     # default of preemption.exit_code: EX_TEMPFAIL, "run me again"
NO_PROGRESS = 79   # recovery.max_attempts_without_progress starts in a row ended without a
                   # new checkpoint: do NOT retry; fix the cause first (docs/RECOVERY.md)
HUNG = 124         # a worker's watchdog: no step finished in recovery.step_timeout_s (as timeout(1))
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): stopped by the user, the state saved first

# Statuses training decides and logs in its ``end`` event, which ``resume`` passes on as
# they are (torchrun reports 1 for every one of them); preemption.exit_code is told apart
# by the checkpoint or the stop it leaves behind.
FINAL = (BAD_INPUT, NOT_SAVED, NO_PROGRESS, INTERRUPTED)


def error_line(exc: BaseException, limit: int | None = 300) -> str:
    """The exception's type and last line, e.g. ``RuntimeError: Connection closed by peer``
    (cut at ``limit`` characters; None: whole). Without DCP's per-rank tracebacks."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[-1].strip() if text else ''}".rstrip(": ")
    return line if limit is None or len(line) <= limit else line[:limit - 3] + "..."


class Refused(Exception):
    """A command will not run (or go on): ``message`` is one sentence, ``status`` the
    exit status it ends with (BAD_INPUT unless said)."""

    def __init__(self, message: object, status: int = BAD_INPUT) -> None:
        super().__init__(str(message))
        self.status = status


def refuse(refusal: Refused) -> int:
    """The one place a refusal is said: ``error: <sentence>`` on stderr; its status."""
    print(error_text(str(refusal)), file=sys.stderr, flush=True)
    return refusal.status


def error_text(sentence: str) -> str:
    return f"error: {sentence}"


def refusals(main: Callable[..., int]) -> Callable[..., int]:
    """A command's ``main(argv) -> int`` whose ``Refused`` ends it in its line and status."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except Refused as exc:
            return refuse(exc)

    return wrapped
