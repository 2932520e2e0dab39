"""Which files under a directory were read while something ran, seen from outside.

``FileReads(root)`` watches ``root`` and every directory created under it with Linux's
inotify (through ctypes: no package) and collects the files that were read (IN_ACCESS)
or opened without writing (IN_CLOSE_NOWRITE), as paths relative to ``root``, in order.
Directories being listed or synced are not counted. Used as a context manager around
a run: ``with FileReads(ckpt) as reads: ...; reads.files``.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from pathlib import Path

IN_ACCESS, IN_CLOSE_NOWRITE, IN_MOVED_TO, IN_CREATE = 0x1, 0x10, 0x80, 0x100
IN_ISDIR = 0x40000000
_MASK = IN_ACCESS | IN_CLOSE_NOWRITE | IN_MOVED_TO | IN_CREATE
_HEADER = struct.Struct("iIII")


class FileReads:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.files: list[str] = []
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._dirs: dict[int, Path] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _watch(self, directory: Path) -> None:
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), _MASK)
        if wd >= 0:
            self._dirs[wd] = directory
            for child in directory.iterdir():   # made before the watch was in place
                if child.is_dir():
                    self._watch(child)

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at < len(data):
                wd, mask, _, size = _HEADER.unpack_from(data, at)
                name = data[at + _HEADER.size:at + _HEADER.size + size].rstrip(b"\0")
                at += _HEADER.size + size
                where = self._dirs.get(wd)
                if where is None or not name:
                    continue
                path = where / os.fsdecode(name)
                if mask & IN_ISDIR:
                    if mask & (IN_CREATE | IN_MOVED_TO):
                        self._watch(path)
                elif mask & (IN_ACCESS | IN_CLOSE_NOWRITE):
                    self.files.append(str(path.relative_to(self.root)))

    def _run(self) -> None:
        while not self._stop.is_set():
            select.select([self._fd], [], [], 0.05)
            self._drain()

    def __enter__(self):
        self.root.mkdir(parents=True, exist_ok=True)
        self._watch(self.root)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._drain()
        os.close(self._fd)
