"""Progress for people (a line every few steps) and for tools (metrics.jsonl)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    """Rank 0 appends one JSON object per line; other ranks get a silent instance."""

    def __init__(self, log_dir: str | None, stream: TextIO = sys.stdout) -> None:
        self.enabled = log_dir is not None
        self.stream = stream
        self._file = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.path = Path(log_dir) / "metrics.jsonl"
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the whole run

    def event(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": kind, **fields, "time": time.time()}) + "\n")

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
