"""Where checkpoint bytes live, behind one small interface.

Everything above this module speaks in names relative to the checkpoint root. A local
(or network-mounted) filesystem can rename a directory atomically; an object store
cannot, which is why the layout's commit never relies on rename alone: the
``commit.json`` file written last is what makes a checkpoint count.

A little over 400 lines: the two storages, their probe, and telling a refusal from an
outage (``is_transient``, which both probes need; the retry policy that uses it is in
``outage.py``) belong to one concern, what the bytes' home can and cannot do.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageWriter

from ...config import OBJECT_STORE_SCHEMES
from ...runtime.exit_codes import error_line
from ...runtime.output_dirs import make_output_dir


class StorageError(OSError):
    """checkpoint.dir cannot hold checkpoints; the message is one sentence that says why."""


class StorageUnavailable(StorageError):
    """checkpoint.dir cannot be reached now (connection refused, timed out, the service
    unavailable): an outage that may pass, not a refusal (checkpoint/store/outage.py)."""


# What a store's client raises when the service cannot be reached, by class name: the
# drivers are optional, so their classes are not imported here.
UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
               "ConnectionClosedError", "ClientConnectorError", "ServerDisconnectedError",
               "ServerTimeoutError", "ProxyConnectionError", "HTTPClientError"}
UNAVAILABLE_CODES = ("ServiceUnavailable", "SlowDown", "InternalError", "RequestTimeout",
                     "503", "502", "504")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the storage could not be reached, rather
    than refused (credentials, permissions, a missing bucket, a full disk)."""
    for cause in causes(exc):
        if isinstance(cause, StorageUnavailable):
            return True
        if isinstance(cause, (ConnectionError, TimeoutError)):
            return True
        if type(cause).__name__ in UNREACHABLE:
            return True
        if type(cause).__name__ == "ClientError" and any(
                code in str(cause) for code in UNAVAILABLE_CODES):
            return True
    return False


class LocalStorage:
    """A checkpoint root on a POSIX filesystem (local disk, NFS, a mounted volume)."""

    atomic_rename = True

    def __init__(self, root: str | os.PathLike) -> None:
        root = str(root)
        self.root = Path(root.removeprefix("file://"))

    def __str__(self) -> str:
        return str(self.root)

    def path(self, name: str) -> str:
        return str(self.root / name)

    def makedirs(self, name: str = "") -> None:
        make_output_dir(self.root)   # a root made here ignores itself in git
        if name:
            (self.root / name).mkdir(parents=True, exist_ok=True)

    def list_names(self) -> list[str]:
        """Entries directly under the root (empty when the root does not exist yet)."""
        try:
            return sorted(entry.name for entry in os.scandir(self.root))
        except FileNotFoundError:
            return []

    def size(self, name: str) -> int | None:
        """Size in bytes, or None when the file is missing."""
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            return None

    def list_files(self, name: str) -> dict[str, int]:
        """Files of a directory with their sizes."""
        directory = self.root / name
        return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}

    def read_text(self, name: str) -> str:
        return (self.root / name).read_text(encoding="utf-8")

    def write_text_durable(self, name: str, text: str) -> None:
        """Write through a temporary file, fsync it and rename it into place."""
        target = self.root / name
        tmp = target.with_name(target.name + ".partial")
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        self._fsync_dir(target.parent)

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.root / src, self.root / dst)
        self._fsync_dir(self.root)

    def remove_tree(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

    def remove_file(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def writer(self, name: str) -> StorageWriter:
        from .checksummed_writer import LocalWriter  # torch only when saving

        return LocalWriter(self.path(name), sync_files=True)

    def open_read(self, name: str) -> IO[bytes]:
        return open(self.root / name, "rb")

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free

    def probe(self) -> None:
        """Check that checkpoints can be written here: create, write, rename, remove."""
        where = f"checkpoint.dir={self.root}"
        probe = self.root / f".probe-{socket.gethostname()}-{os.getpid()}"
        step = f"cannot look at {self.root}"
        try:
            if self.root.exists() and not self.root.is_dir():
                raise StorageError(f"{where} is not a directory (a file of that name exists)")
            step = f"cannot create {self.root}"
            make_output_dir(self.root)
            step = f"cannot write a file in {self.root}"
            with open(probe, "wb") as handle:
                handle.write(b"probe\n")
                handle.flush()
                os.fsync(handle.fileno())
            step = f"cannot rename a file in {self.root}"
            os.replace(probe, probe.with_name(probe.name + ".renamed"))
            probe = probe.with_name(probe.name + ".renamed")
            step = f"cannot sync the directory {self.root}"   # as every commit does
            self._fsync_dir(self.root)
            step = f"cannot remove a file in {self.root}"
            probe.unlink()
        except StorageError:
            raise
        except OSError as exc:
            try:
                probe.unlink(missing_ok=True)
            except OSError:
                pass
            raise StorageError(f"{where} is not usable: {step}: {_os_cause(exc)}") from None

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class FsspecStorage:
    """A checkpoint root in an object store (s3://, gs://, az://, ...) through fsspec.

    Objects appear whole or not at all, but there is no atomic rename of a "directory":
    shards are written straight into ``step_<n>/`` and ``commit.json`` alone decides.
    Credentials and endpoints come from the usual environment (AWS_*, GOOGLE_*, ...).
    """

    atomic_rename = False

    def __init__(self, url: str) -> None:
        import fsspec  # optional: pip install -e '.[s3]' (or gcs, azure)

        self.url = url.rstrip("/")
        self.fs, self._root = fsspec.core.url_to_fs(self.url)

    def __str__(self) -> str:
        return self.url

    def path(self, name: str) -> str:
        return f"{self.url}/{name}" if name else self.url

    def _key(self, name: str) -> str:
        return f"{self._root}/{name}" if name else self._root

    def makedirs(self, name: str = "") -> None:
        self.fs.makedirs(self._key(name), exist_ok=True)

    def list_names(self) -> list[str]:
        try:
            entries = self.fs.ls(self._root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def size(self, name: str) -> int | None:
        try:
            return int(self.fs.size(self._key(name)))
        except FileNotFoundError:
            return None

    def list_files(self, name: str) -> dict[str, int]:
        entries = self.fs.ls(self._key(name), detail=True, refresh=True)
        return {e["name"].rsplit("/", 1)[-1]: int(e["size"]) for e in entries
                if e["type"] == "file"}

    def read_text(self, name: str) -> str:
        return self.fs.cat_file(self._key(name)).decode("utf-8")

    def write_text_durable(self, name: str, text: str) -> None:
        # A single PUT: the object is visible complete or not at all.
        self.fs.pipe_file(self._key(name), text.encode("utf-8"))

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError("object stores have no atomic rename")

    def remove_tree(self, name: str) -> None:
        try:
            self.fs.rm(self._key(name), recursive=True)
        except FileNotFoundError:
            pass

    def remove_file(self, name: str) -> None:
        try:
            self.fs.rm_file(self._key(name))
        except FileNotFoundError:
            pass

    def writer(self, name: str) -> StorageWriter:
        from .checksummed_fsspec import ObjectStoreWriter  # over DCP's FsspecWriter

        return ObjectStoreWriter(self.path(name), sync_files=True)

    def open_read(self, name: str) -> IO[bytes]:
        return self.fs.open(self._key(name), "rb")

    def free_bytes(self) -> None:
        return None  # an object store has no free space to run out of

    def probe(self) -> None:
        """List, write, read back and delete a small object: credentials and bucket exist."""
        where = f"checkpoint.dir={self.url}"
        name = f".probe-{socket.gethostname()}-{os.getpid()}"
        step = "cannot list it"
        try:
            try:
                self.fs.ls(self._root, detail=False, refresh=True)
            except FileNotFoundError:
                pass  # an empty prefix; the write below tells a missing bucket apart
            step = "cannot write an object to it"
            self.fs.pipe_file(self._key(name), b"probe\n")
            step = "cannot read back an object written to it"
            if int(self.fs.size(self._key(name))) != 6:
                raise OSError(errno.EIO, "the object read back has the wrong size")
            step = "cannot delete an object from it"
            self.fs.rm_file(self._key(name))
        except Exception as exc:  # noqa: BLE001 - drivers raise their own classes
            kind = StorageUnavailable if is_transient(exc) else StorageError
            raise kind(f"{where} is not usable: {step}: {store_cause(exc)}") from None


Storage = LocalStorage | FsspecStorage


def probe(storage: Storage, needed_bytes: int | None = None, detail: str = "") -> None:
    """Refuse storage that cannot hold checkpoints, before anything is built.

    Raises StorageError with one sentence naming checkpoint.dir and the cause: not a
    directory, read-only, permission denied, a rename that fails, less free space than
    ``needed_bytes`` (skipped when None; ``detail`` says how it was estimated), missing
    credentials or bucket.
    """
    storage.probe()
    check_space(storage, needed_bytes, detail)


def check_space(storage: Storage, needed_bytes: int | None, detail: str = "") -> None:
    """StorageError when a local root has less than ``needed_bytes`` free (None: unknown)."""
    free = storage.free_bytes() if needed_bytes is not None else None
    if free is not None and needed_bytes > free:
        raise StorageError(
            f"checkpoint.dir={storage} has not enough free space: "
            f"{human_bytes(needed_bytes)} needed{f' ({detail})' if detail else ''}, "
            f"{human_bytes(free)} free")


def save_failures(exc: BaseException) -> list[BaseException]:
    """The failure of each rank in DCP's CheckpointException (its ``failures``), or the
    exception itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [exc]


def describe_save_error(exc: BaseException, path: str) -> str:
    """One sentence for a failed save: which path, which rank, and why (errno when known).

    DCP wraps each rank's failure in a CheckpointException; a failed write often shows up
    as torch's "unexpected pos N vs M" with the OSError (ENOSPC...) only as its context,
    and a failure that crossed a process boundary (another rank, the checkpoint process)
    has lost that context: then the free space of a local path is looked at.
    """
    failures = getattr(exc, "failures", None)
    inner, where = exc, ""
    if isinstance(failures, dict) and failures:
        ranks = sorted(failures)
        first = failures[ranks[0]]
        inner = first[0] if isinstance(first, tuple) else first
        where = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    for cause in causes(inner):
        if isinstance(cause, OSError) and cause.errno:
            return f"checkpoint save to {path} failed{where}: {_os_cause(cause)}"
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


def _os_cause(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0)
    text = (exc.strerror or os.strerror(exc.errno) if exc.errno else str(exc)).lower()
    return f"{text} ({code})" if code else text


def store_cause(exc: Exception) -> str:
    kind = type(exc).__name__
    if is_transient(exc):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
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
        return _os_cause(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{kind}: {first}" if first else kind


def human_bytes(n: float) -> str:
    """A byte count for people: 512 bytes, 3.1 MiB, 1.2 TiB."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


def open_storage(url: str) -> Storage:
    """The storage for ``checkpoint.dir``: a path, a file:// URL or an object-store URL."""
    if url.startswith(tuple(f"{scheme}://" for scheme in OBJECT_STORE_SCHEMES)):
        try:
            return FsspecStorage(url)
        except ImportError as exc:
            extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(url.split("://")[0], "azure")
            raise RuntimeError(
                f"checkpoint.dir={url!r} needs fsspec and the store's driver: "
                f"pip install -e '.[{extra}]' ({exc})") from None
    return LocalStorage(url)
