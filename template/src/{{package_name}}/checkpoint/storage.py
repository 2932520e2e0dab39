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


def open_storage(url: str) -> LocalStorage:
    """The storage for ``checkpoint.dir``: a path or a file:// URL."""
    if url.startswith(_URL_SCHEMES):
        raise NotImplementedError(
            f"checkpoint.dir={url!r}: object-store URLs are not supported by this version of "
            "the project yet; mount the bucket (e.g. with a FUSE driver) and give its path"
        )
    return LocalStorage(url)
