"""Fixed-length windows of a tokenized corpus on disk: the default task's ``data.kind: tokens``.

A token directory (written by ``python -m <package>.prepare_data``) holds flat token
files (``uint16`` when the vocabulary fits, else ``uint32``) and ``index.json``. The files
are one stream in index order; a sample reads only its own window, one ``os.pread`` per
file it spans, so resident memory does not grow with the corpus (memory-mapping did: whole
large folios get mapped; 500 random windows of a 500 MB file added 428 MB).
Samples are windowed as in ``datasets/text.py``, across separators and file boundaries.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import PACKAGE
from ..config import ConfigError, require

INDEX_FILE = "index.json"
FORMAT = "resumable-tokens"
VERSION = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
PREPARE = f"python -m {PACKAGE}.prepare_data"


def dtype_for(vocab_size: int) -> str:
    """The smallest dtype that holds every token id of a vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def dtype_fits(dtype: str, vocab_size: int) -> bool:
    return vocab_size - 1 <= np.iinfo(DTYPES[dtype]).max


@dataclass
class TokenConfig:
    path: str = ""              # a directory written by prepare_data (index.json + token files)
    seq_len: int = 64
    eval_fraction: float = 0.05  # the last samples, held out for evaluation (0 = none)

    def __post_init__(self) -> None:
        require(0 <= self.eval_fraction < 1, "data.eval_fraction", "must be in [0, 1)",
                self.eval_fraction)
        if not self.path:
            raise ConfigError(f"data.kind=tokens needs data.path: a directory written by "
                              f"`{PREPARE}`")
        require(self.seq_len >= 2, "data.seq_len", "must be >= 2", self.seq_len)


def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    """The index of a token directory, checked against its files (ConfigError otherwise)."""
    directory = Path(directory)
    where = f"data.path {str(directory)!r}"
    try:
        index = json.loads((directory / INDEX_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where} has no {INDEX_FILE}: prepare it with `{PREPARE}`") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: {INDEX_FILE} cannot be read: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"{where}: {INDEX_FILE} is not a token index (format {FORMAT!r})")
    if index.get("version") != VERSION or index.get("dtype") not in DTYPES:
        raise ConfigError(f"{where}: {INDEX_FILE} has version {index.get('version')!r} and "
                          f"dtype {index.get('dtype')!r}; this code reads version {VERSION}, "
                          f"dtype {' or '.join(DTYPES)}")
    itemsize = np.dtype(DTYPES[index["dtype"]]).itemsize
    for entry in index["files"]:
        size = (directory / entry["name"]).stat().st_size \
            if (directory / entry["name"]).is_file() else None
        if size != entry["tokens"] * itemsize:
            found = "missing" if size is None else f"{size} bytes"
            raise ConfigError(f"{where}: {entry['name']} is {found}, the index says "
                              f"{entry['tokens']} tokens of {index['dtype']}")
    return index


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens over the token files; (inputs, targets) as int64."""

    def __init__(self, directory: str | os.PathLike, seq_len: int) -> None:
        self.directory = Path(directory)
        self.index = read_index(self.directory)
        self.seq_len = seq_len
        self.dtype = np.dtype(DTYPES[self.index["dtype"]])
        files = [f for f in self.index["files"] if f["tokens"] > 0]
        self.names = [f["name"] for f in files]
        # The stream offset of each file's first token, then the total.
        self.starts = [0, *itertools.accumulate(f["tokens"] for f in files)]
        self.total_tokens = self.starts[-1]
        self.vocab_size = int(self.index["vocab_size"])
        self._files: list[int] | None = None  # opened on first use, in each process

    @classmethod
    def from_config(cls, cfg: TokenConfig) -> TokenWindows:
        dataset = cls(cfg.path, cfg.seq_len)
        if dataset.total_tokens <= cfg.seq_len:
            raise ConfigError(f"data.path {cfg.path!r} holds {dataset.total_tokens} tokens, "
                              f"fewer than one sample of data.seq_len={cfg.seq_len} + 1")
        return dataset

    def __len__(self) -> int:
        return (self.total_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range [0, {len(self)})")
        start = index * self.seq_len
        window = torch.from_numpy(self.read(start, start + self.seq_len + 1).astype(np.int64))
        return window[:-1], window[1:]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start`` to ``stop`` of the stream (across files when needed)."""
        files = self._open()
        size = self.dtype.itemsize
        parts = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            local = start - self.starts[i]
            take = min(stop, self.starts[i + 1]) - start
            data = os.pread(files[i], take * size, local * size)
            if len(data) != take * size:
                raise OSError(f"{self.directory / self.names[i]} is shorter than its index says")
            parts.append(np.frombuffer(data, dtype=self.dtype))
            start += take
            i += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _open(self) -> list[int]:
        if self._files is None:
            files = [os.open(self.directory / name, os.O_RDONLY) for name in self.names]
            if hasattr(os, "posix_fadvise"):
                for fd in files:  # windows are read in a random order: no read-ahead
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._files = files
        return self._files

    def __getstate__(self) -> dict[str, Any]:
        # Spawned workers open the files themselves; forked ones share them (pread has no offset).
        return {**self.__dict__, "_files": None}

    def __del__(self) -> None:
        for fd in self.__dict__.get("_files") or ():
            with contextlib.suppress(OSError):
                os.close(fd)
