"""DCP's fsspec writer (object stores), every file checksummed as it is written.

A module of its own: fsspec is optional, and the classes must be importable by name in
the checkpoint process that unpickles the writer (``checksummed_writer`` explains them).
"""

from __future__ import annotations

from typing import Any

# A private module (public since torch 2.2 in all but name).
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from . import integrity
from .checksummed_writer import ChecksummingFileSystem, ChecksummingWriterMixin


class _FsspecFileSystem(ChecksummingFileSystem, FileSystem):
    """DCP's fsspec FileSystem, checksumming."""


class ObjectStoreWriter(ChecksummingWriterMixin, FsspecWriter):
    """DCP's FsspecWriter, every file checksummed as it is written."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.fs = _FsspecFileSystem()
        self.fs.block_bytes = integrity.BLOCK_BYTES   # the value here, not the process's
        self.path = self.fs.init_path(url)
