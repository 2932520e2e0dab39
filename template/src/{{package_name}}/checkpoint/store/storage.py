"""Where checkpoint bytes live, behind one small interface: a local (or network-mounted)
filesystem, or an object store through fsspec; their probe before anything is built.

Everything above speaks in names relative to the checkpoint root. Only a filesystem renames
a directory atomically: a checkpoint counts once its ``commit.json``, written last, is there
(docs/RESUMING.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageWriter

from ...config import OBJECT_STORE_SCHEMES
from ...runtime.output_dirs import make_output_dir
from .errors import (
    StorageError,
    StorageUnavailable,
    human_bytes,
    is_transient,
    os_cause,
    store_cause,
)


class LocalStorage:
    """A checkpoint root on a POSIX filesystem (local disk, NFS, a mounted volume)."""

    atomic_rename = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(str(root).removeprefix("file://"))

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
        return {p.name: p.stat().st_size for p in (self.root / name).iterdir() if p.is_file()}

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
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
            raise StorageError(f"{where} is not usable: {step}: {os_cause(exc)}") from None

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class FsspecStorage:
    """A checkpoint root in an object store (s3://, gs://, az://, ...) through fsspec.

    No "directory" renames atomically: shards go straight into ``step_<n>/`` and
    ``commit.json`` alone decides. Credentials come from the environment (AWS_*, ...)."""

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
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._key(name), recursive=True)

    def remove_file(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name))

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
            # An empty prefix is FileNotFoundError; the write below tells a missing bucket apart.
            with contextlib.suppress(FileNotFoundError):
                self.fs.ls(self._root, detail=False, refresh=True)
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


def probe(storage: Storage) -> None:
    """StorageError (one sentence: checkpoint.dir and the cause) where checkpoints cannot go."""
    storage.probe()


def check_space(storage: Storage, needed_bytes: int | None, detail: str = "") -> None:
    """StorageError when a local root has less than ``needed_bytes`` free (None: unknown)."""
    free = storage.free_bytes() if needed_bytes is not None else None
    if free is not None and needed_bytes > free:
        raise StorageError(
            f"checkpoint.dir={storage} has not enough free space: "
            f"{human_bytes(needed_bytes)} needed{f' ({detail})' if detail else ''}, "
            f"{human_bytes(free)} free")


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
