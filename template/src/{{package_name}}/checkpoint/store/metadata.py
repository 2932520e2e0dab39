"""Reading a checkpoint's ``.metadata`` without running code from it.

``.metadata`` is a pickle: ``load_metadata`` builds only the classes DCP's metadata is made of
(checked against sync, thread and process saves, FSDP2 on one and two ranks, local and fsspec
storage), refusing anything else with ``UnsafeCheckpointError``, for ``layout.py`` and the
load's readers. docs/RESUMING.md, "Trusting a checkpoint".
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

# Everything a real .metadata holds (torch 2.13): DCP's metadata dataclasses, the
# filesystem layer's _StorageInfo, torch.Size, dtypes (any torch.dtype), layouts
# (rebuilt by name through torch.serialization._get_layout) and the checkpoint path.
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}

TRUST_NOTE = ("a checkpoint's .metadata is a pickle, and loading it with DCP's own reader "
              "would run whatever it names; see docs/RESUMING.md, 'Trusting a checkpoint'")


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint holds something other than DCP's metadata, tensors and plain values."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refusing to load {self.where}: it names {module}.{name}, which is not part "
            f"of DCP's metadata ({TRUST_NOTE})")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"refusing to load {self.where}: it uses a persistent id, "
                                    f"which DCP's metadata never does ({TRUST_NOTE})")


def load_metadata(data: bytes | io.BufferedIOBase | Any, where: str) -> Metadata:
    """Unpickle DCP metadata (``where`` names the file in messages), allowing only its
    classes: UnsafeCheckpointError for anything else, or a pickle that is not DCP metadata."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        metadata = _MetadataUnpickler(stream, where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - garbage raises any of a dozen types
        raise UnsafeCheckpointError(f"cannot read {where}: not a valid DCP metadata file "
                                    f"({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"refusing to load {where}: it holds a "
                                    f"{type(metadata).__name__}, not DCP's Metadata")
    return metadata
