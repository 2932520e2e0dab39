"""Storage that cannot be reached: wait out a passing outage within a bound, and end
every command's storage error in one sentence and a documented status.

An outage is retried (``BACKOFF_S``) until ``checkpoint.storage_retry_s`` has passed, then
ends the command with ``NOT_SAVED`` (73, "run again"); a refusal (credentials, no such
bucket, permission denied) at once with ``BAD_INPUT`` (2). docs/RECOVERY.md, "Storage that
cannot be reached".
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from ...runtime import exit_codes
from ...runtime.exit_codes import Refused, error_line
from .errors import StorageError, StorageUnavailable, causes, is_transient, store_cause

T = TypeVar("T")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)   # then 30 s between tries


def with_retries(call: Callable[[], T], where: str, budget_s: float,
                 say: Callable[[str], None] | None = None) -> T:
    """``call()``, tried again while the storage cannot be reached, for at most
    ``budget_s`` seconds; raises StorageUnavailable (one sentence) when it stays away."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    deadline = time.monotonic() + budget_s
    tries = 0
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            what = str(exc) if isinstance(exc, StorageUnavailable) else (
                f"{where} cannot be reached: {error_line(exc)}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageUnavailable(f"{what}; still so after {budget_s:g} s of tries "
                                         "(checkpoint.storage_retry_s)") from None
            delay = min(BACKOFF_S[min(tries, len(BACKOFF_S) - 1)], left)
            tries += 1
            say(f"{what[:300]}; try {tries + 1} in {delay:.0f} s, giving up after "
                f"{budget_s:g} s")
            time.sleep(delay)


def command_failure(exc: BaseException, where: str) -> tuple[int, str] | None:
    """The exit status and sentence for a storage error that ended a command; None if not one."""
    if is_transient(exc):
        message = str(exc) if isinstance(exc, StorageUnavailable) else (
            f"{where} cannot be reached: {error_line(exc)}")
        return exit_codes.NOT_SAVED, f"{message}; run again once it is back"
    if isinstance(exc, StorageError):
        return exit_codes.BAD_INPUT, str(exc)
    for cause in causes(exc):
        if isinstance(cause, OSError) or type(cause).__name__ in (
                "NoCredentialsError", "ClientError", "BotoCoreError", "PartialCredentialsError"):
            return exit_codes.BAD_INPUT, f"{where}: {store_cause(cause)}"
    return None


def ends_storage_errors(main: Callable[..., int]) -> Callable[..., int]:
    """A command's ``main`` whose storage errors are refusals: ``command_failure``'s
    sentence and status. Goes under ``exit_codes.refusals``, which says them."""
    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except Refused:
            raise
        except Exception as exc:
            if (failure := command_failure(exc, "the checkpoint storage")) is None:
                raise
            raise Refused(failure[1], failure[0]) from exc

    return wrapped
