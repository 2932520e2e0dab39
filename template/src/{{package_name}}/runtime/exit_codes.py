"""The exit statuses of every command, defined once (docs/PREEMPTION.md and
docs/RECOVERY.md explain them).

0, ``BAD_INPUT`` and ``NO_PROGRESS`` end the job; ``PREEMPTED`` (``preemption.exit_code``),
``NOT_SAVED`` and ``NODE_LOST`` ask for another run; on ``HUNG``, a worker's own, torchrun
restarts the workers in place. A command refuses by raising ``Refused`` (a sentence, a
status): ``refusals`` around its ``main`` says ``error: <sentence>`` on stderr, no traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

OK = 0             # finished (train, resume), passed (drill, verify)
FAILED = 1         # crashed, or a check failed (drill, verify)
BAD_INPUT = 2      # refused before running: configuration, arguments, a task breaking its contract
NOT_SAVED = 73     # training ended but its last state is not in a committed checkpoint: run again
NODE_LOST = 74     # a node of several was lost, the others stopped: run again
PREEMPTED = 75     # default of preemption.exit_code: EX_TEMPFAIL, "run me again"
NO_PROGRESS = 79   # starts kept failing without a new checkpoint: do NOT retry; fix the cause
HUNG = 124         # a worker's watchdog: no step finished in recovery.step_timeout_s (as timeout(1))
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): stopped by the user, the state saved first

# Statuses training logs in its ``end`` event and ``resume`` passes on (torchrun says 1).
FINAL = (BAD_INPUT, NOT_SAVED, NO_PROGRESS, INTERRUPTED)


def error_line(exc: BaseException, limit: int | None = 300) -> str:
    """The exception's type and last line (no DCP per-rank tracebacks), cut at ``limit``."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[-1].strip() if text else ''}".rstrip(": ")
    return line if limit is None or len(line) <= limit else line[:limit - 3] + "..."


class Refused(Exception):
    """A command will not run (or go on): ``message`` is one sentence, ``status`` its exit."""

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
