"""What a storage failure means: a refusal or an outage that may pass (``is_transient``;
the retries are in ``outage.py``), and the one sentence that says why a save failed."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ...runtime.exit_codes import error_line


class StorageError(OSError):
    """checkpoint.dir cannot hold checkpoints; the message is one sentence that says why."""


class StorageUnavailable(StorageError):
    """checkpoint.dir cannot be reached now: an outage that may pass, not a refusal."""


# Store clients' exceptions for a service not reached, by name (the drivers are optional).
UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
               "ConnectionClosedError", "ClientConnectorError", "ServerDisconnectedError",
               "ServerTimeoutError", "ProxyConnectionError", "HTTPClientError"}
UNAVAILABLE_CODES = ("ServiceUnavailable", "SlowDown", "InternalError", "RequestTimeout",
                     "503", "502", "504")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the storage could not be reached, rather
    than refused (credentials, permissions, a missing bucket, a full disk)."""
    return any(isinstance(cause, (StorageUnavailable, ConnectionError, TimeoutError))
               or type(cause).__name__ in UNREACHABLE
               or (type(cause).__name__ == "ClientError"
                   and any(code in str(cause) for code in UNAVAILABLE_CODES))
               for cause in causes(exc))


def save_failures(exc: BaseException) -> list[BaseException]:
    """Each rank's failure in DCP's CheckpointException (``failures``), by rank, or ``[exc]``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
    return [exc]


def describe_save_error(exc: BaseException, path: str) -> str:
    """One sentence for a failed save: path, rank, and why: the errno when known (a failure
    from another process has lost it: then a local path's free space is looked at)."""
    failures = getattr(exc, "failures", None)
    inner, where = save_failures(exc)[0], ""
    if isinstance(failures, dict) and failures:
        ranks = sorted(failures)
        where = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    for cause in causes(inner):
        if isinstance(cause, OSError) and cause.errno:
            return f"checkpoint save to {path} failed{where}: {os_cause(cause)}"
    message = error_line(inner, limit=None)   # a KeyError's text alone is a bare key
    if isinstance(inner, RuntimeError):       # torch's own failures say what they are
        message = message.removeprefix("RuntimeError: ")
    if "unexpected pos" in message:  # torch's zip writer: fewer bytes reached the file
        message += " (a write came up short)"
    hint = ""
    if "://" not in path:
        existing = Path(path)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        try:
            usage = shutil.disk_usage(existing)
        except OSError:
            usage = None
        if usage is not None and usage.free < max(64 << 20, usage.total // 100):
            hint = (f"; the filesystem has {human_bytes(usage.free)} free of "
                    f"{human_bytes(usage.total)}: probably out of space (ENOSPC)")
    return f"checkpoint save to {path} failed{where}: {message}{hint}"


def causes(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def os_cause(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0)
    text = (exc.strerror or os.strerror(exc.errno) if exc.errno else str(exc)).lower()
    return f"{text} ({code})" if code else text


def store_cause(exc: Exception) -> str:
    kind = type(exc).__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if is_transient(exc):
        return f"cannot be reached ({kind}{': ' + first if first else ''})"
    if kind == "NoCredentialsError" or "credentials" in str(exc).lower():
        return (f"no credentials found ({kind}): set them in the environment "
                "(e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or attach "
                "a role to the machine")
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in str(exc):
        return f"the bucket or container does not exist ({kind})"
    if isinstance(exc, PermissionError):
        return f"permission denied ({kind}: {exc})"
    if isinstance(exc, OSError) and exc.errno:
        return os_cause(exc)
    return f"{kind}: {first}" if first else kind


def human_bytes(n: float) -> str:
    """A byte count for people: 512 bytes, 3.1 MiB, 1.2 TiB."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
