"""Loading a checkpoint without running code from it.

DCP's own loader runs whatever ``.metadata`` (a pickle) and the non-tensor values name. Here
``read_metadata`` knows only DCP's metadata classes (``store/metadata.py``) and
``SafeLoadPlanner.load_bytes`` uses ``torch.load(weights_only=True)``; anything else is
refused with ``UnsafeCheckpointError`` before it is built. docs/RESUMING.md, "Trusting a
checkpoint".
"""

from __future__ import annotations

import io
import pickle
from functools import cache
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from ..store.errors import save_failures
from ..store.metadata import TRUST_NOTE, UnsafeCheckpointError, load_metadata

__all__ = ["TRUST_NOTE", "SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError",
           "failure_of", "load_metadata", "safe_fsspec_reader_class", "unsafe_failure"]

class _SafeMetadataMixin:
    """``read_metadata`` of FileSystemReader, with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._parse_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _parse_metadata(self, path: Any) -> Metadata:
        with self.fs.create_stream(path, "rb") as stream:
            return load_metadata(stream, str(path))


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    """DCP's local-filesystem reader, reading ``.metadata`` with the restricted unpickler
    (tensor data as DCP always reads it, with ``torch.load(weights_only=True)``)."""


@cache
def safe_fsspec_reader_class() -> type:
    """DCP's fsspec reader (object stores), reading ``.metadata`` with the restricted unpickler."""
    # Built on first use: fsspec is optional. A private module, public in all but name.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return type("SafeFsspecReader", (_SafeMetadataMixin, FsspecReader), {})


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values load with ``weights_only=True``
    (DefaultLoadPlanner.load_bytes: ``False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsafeCheckpointError(
                f"refusing to load the value {fqn!r}: it is not plain data ({first})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def unsafe_failure(exc: BaseException) -> UnsafeCheckpointError | None:
    """The UnsafeCheckpointError inside a CheckpointException (any rank's), if there is one."""
    return failure_of(exc, UnsafeCheckpointError)


def failure_of(exc: BaseException, kind: type[BaseException]) -> Any:
    """The first ``kind`` error in a CheckpointException's ranks' failures (or ``exc``), or None."""
    if isinstance(exc, kind):
        return exc
    return next((f for f in save_failures(exc) if isinstance(f, kind)), None)
