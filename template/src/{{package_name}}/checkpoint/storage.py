"""Where checkpoint bytes live, behind one small interface.

Everything above this module speaks in names relative to the checkpoint root. A local
(or network-mounted) filesystem can rename a directory atomically; an object store
cannot, which is why the commit protocol never relies on rename alone: the
``commit.json`` file written last is what makes a checkpoint count.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint import (
    FileSystemReader,
    FileSystemWriter,
    StorageReader,
    StorageWriter,
)

_URL_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "abfss://")


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
        return FileSystemWriter(self.path(name), sync_files=True)

    def reader(self, name: str) -> StorageReader:
        return FileSystemReader(self.path(name))

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
        # DCP's fsspec writer lives in a private module (public since torch 2.2 in all but name).
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.path(name), sync_files=True)

    def reader(self, name: str) -> StorageReader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.path(name))


Storage = LocalStorage | FsspecStorage


def open_storage(url: str) -> Storage:
    """The storage for ``checkpoint.dir``: a path, a file:// URL or an object-store URL."""
    if url.startswith(_URL_SCHEMES):
        try:
            return FsspecStorage(url)
        except ImportError as exc:
            extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(url.split("://")[0], "azure")
            raise RuntimeError(
                f"checkpoint.dir={url!r} needs fsspec and the store's driver: "
                f"pip install -e '.[{extra}]' ({exc})") from None
    return LocalStorage(url)
