"""When failing saves end training: a budget in count and in time.

Training stops with exit 73 only once both are spent: ``checkpoint.max_failed_saves``
saves in a row have failed, and none has committed for ``checkpoint.max_failed_saves_s``
(before this start's first commit, counted from when its training began). Why both, and
the bounds that follow: docs/RECOVERY.md, "When failing saves stop training".

Every rank decides alike: the count is the step-boundary vote's (the most failed saves
on any rank), the seconds rank 0's, which alone commits (``decide_on_rank0``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..runtime.distributed import decide_on_rank0


class FailedSaves:
    """Failed saves in a row and the time since the newest commit, against their budget."""

    def __init__(self, max_in_a_row: int, max_without_commit_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_in_a_row = max_in_a_row
        self.max_without_commit_s = max_without_commit_s
        self.clock = clock
        self.in_a_row = 0
        self.seconds_without_commit = 0.0   # as rank 0 measured it, at the newest failure
        self._seen = 0                      # the agreed count of failed saves, this run
        self._committed_at = clock()        # nothing of this start is at risk before it

    def committed(self) -> None:
        """A save committed (rank 0: the only one that commits)."""
        self._committed_at = self.clock()

    def count(self, failed_saves: int) -> bool:
        """At a due step, with the vote's count of failed saves (the same on every rank):
        whether a save failed since the last due step. One that did not resets the row."""
        if failed_saves <= self._seen:
            self.in_a_row = 0
            return False
        self._seen = failed_saves
        self.in_a_row += 1
        return True

    def spent(self) -> bool:
        """Whether the failures in a row end training (call on every rank after ``count``
        found a failure: a collective once the count is spent)."""
        if self.in_a_row < self.max_in_a_row:
            return False
        self.seconds_without_commit = float(
            decide_on_rank0(lambda: self.clock() - self._committed_at))
        return self.seconds_without_commit >= self.max_without_commit_s

    def why(self, last_error: str) -> str:
        """The reason training stops, once ``spent``."""
        if self.max_without_commit_s <= 0:
            return f"{self.in_a_row} save(s) in a row failed, the last: {last_error}"
        return (f"{self.in_a_row} save(s) in a row failed and none committed for "
                f"{self.seconds_without_commit:.0f} s (checkpoint.max_failed_saves="
                f"{self.max_in_a_row}, max_failed_saves_s={self.max_without_commit_s:g}), "
                f"the last: {last_error}")

    def waiting(self) -> str | None:
        """After ``spent`` said no: the line for the log when the count has just been spent
        and only the time holds training on (once a row: every failure is logged anyway)."""
        if self.in_a_row != self.max_in_a_row:
            return None
        return (f"{self.in_a_row} save(s) in a row failed, none committed for "
                f"{self.seconds_without_commit:.0f} s: training goes on until "
                f"{self.max_without_commit_s:g} s without a commit "
                "(checkpoint.max_failed_saves_s)")
