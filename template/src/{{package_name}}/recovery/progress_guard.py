"""The no-progress guard: a job whose starts keep failing stops asking to be retried.

    <checkpoint.dir>/progress.json   {"newest_step", "failed_starts", "last_counted", "history"}

Rank 0 counts each start that failed without a newer step to restart from
(``Checkpointer.newest_recoverable_step``); at ``recovery.max_attempts_without_progress``
the start refuses with exit 79. The file (through Storage) exists only while failures are
counted. docs/RECOVERY.md, "No progress: stop asking to be retried".
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..checkpoint.store.storage import Storage
from ..runtime.exit_codes import NOT_SAVED
from .attempts import FAILURES

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
HISTORY = 10  # causes kept, for the message


class ProgressGuard:
    def __init__(self, storage: Storage, limit: int) -> None:
        self.storage = storage
        self.limit = limit

    @property
    def path(self) -> str:
        return self.storage.path(PROGRESS_FILE)

    def read(self) -> dict[str, Any] | None:
        """The count, or None when no failure is being counted."""
        try:
            state = json.loads(self.storage.read_text(PROGRESS_FILE))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("%s is unreadable (%s): counting failed starts afresh", self.path, exc)
            return None
        if not (isinstance(state, dict) and isinstance(state.get("newest_step"), int)
                and isinstance(state.get("failed_starts"), int)):
            return None
        state.setdefault("history", [])
        return state

    def _write(self, state: dict[str, Any]) -> None:
        try:
            self.storage.write_text_durable(PROGRESS_FILE, json.dumps(state))
        except OSError as exc:  # the guard must never stop training that works
            log.warning("could not update %s: %s", self.path, exc)

    def _clear(self) -> None:
        try:
            self.storage.remove_file(PROGRESS_FILE)
        except OSError as exc:
            log.warning("could not remove %s: %s", self.path, exc)

    def on_start(self, newest_step: int | None,
                 previous: dict[str, Any] | None) -> tuple[int, str | None]:
        """Count ``previous`` if it failed without progress; the count, and why not to run."""
        state = self.read()
        newest = -1 if newest_step is None else newest_step
        failed = previous is not None and (
            previous.get("kind") in FAILURES
            # saves failed: a storage that stays broken would be requeued for ever
            or (previous.get("kind") == "exit" and previous.get("status") == NOT_SAVED))
        if failed:
            # Newest when that start began; unknown: it died before it looked (nor committed)
            began = previous.get("newest_step")
            if began is None:
                began = state["newest_step"] if state is not None else newest
            if newest > began:
                failed = False              # it committed a newer checkpoint before failing
        if failed:
            key = previous.get("attempt")
            if state is None:
                state = {"newest_step": newest, "failed_starts": 0, "last_counted": None,
                         "history": []}
            if key is None or key != state.get("last_counted"):
                state["failed_starts"] += 1
                state["last_counted"] = key
                state["history"] = [*state["history"], previous.get("summary", "")][-HISTORY:]
                state["updated"] = time.time()
                self._write(state)
        elif state is not None and newest > state["newest_step"]:
            self._clear()               # progress since the count began
            state = None
        count = state["failed_starts"] if state is not None else 0
        return count, self._refusal(state) if self.limit and count >= self.limit else None

    def _refusal(self, state: dict[str, Any]) -> str:
        newest = state["newest_step"]
        where = f"step {newest}" if newest >= 0 else "none"
        causes = " | ".join(dict.fromkeys(state["history"])) or "not recorded"
        return (f"{state['failed_starts']} start(s) in a row failed without committing a new "
                f"checkpoint (recovery.max_attempts_without_progress={self.limit}; the "
                f"newest checkpoint is {where}). Cause(s): {causes}. Retrying will not help "
                f"until the cause is fixed; then remove {self.path} (or raise "
                "recovery.max_attempts_without_progress, 0 = no limit) and run again")
