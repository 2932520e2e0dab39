"""When failing saves end training: a budget in count and in time.

Training stops with exit 73 only once ``checkpoint.max_failed_saves`` saves in a row
have failed and none has committed for ``checkpoint.max_failed_saves_s`` (counted from
this start's training until its first commit). Every rank decides alike: the count is
the step-boundary vote's (the most on any rank), the seconds rank 0's (it alone commits).
Why both: docs/RECOVERY.md, "When failing saves stop training".
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
        """A save committed (rank 0)."""
        self._committed_at = self.clock()

    def count(self, failed_saves: int) -> bool:
        """At a due step, with the vote's count: whether a save failed since the last one."""
        if failed_saves <= self._seen:
            self.in_a_row = 0
            return False
        self._seen = failed_saves
        self.in_a_row += 1
        return True

    def spent(self) -> bool:
        """Whether the failures end training (every rank, after ``count`` found one: a
        collective once the count is spent)."""
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
        """After ``spent`` said no: a log line once a row, when the count has just been
        spent and only the time keeps training on."""
        if self.in_a_row != self.max_in_a_row:
            return None
        return (f"{self.in_a_row} save(s) in a row failed, none committed for "
                f"{self.seconds_without_commit:.0f} s: training goes on until "
                f"{self.max_without_commit_s:g} s without a commit "
                "(checkpoint.max_failed_saves_s)")
