"""``resume`` waits for every process of its launch, the ones its agent leaves behind too.

On Linux ``resume`` is its launch's child subreaper: an orphan of the launch comes back to
it and is reaped before the verdict, so nothing of the old launch still writes into
``checkpoint.dir`` when the next one starts. The wait is bounded; what still runs is then
killed and named (docs/PREEMPTION.md, the table of processes killed outright).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time

from ..runtime.process_tree import children, command_of, kill_tree
from ..runtime.process_tree import prctl as _prctl

PR_SET_CHILD_SUBREAPER = 36   # linux/prctl.h
PR_GET_CHILD_SUBREAPER = 37
POLL_S = 0.1
REAP_EVERY_S = 1.0             # while the agent runs: the zombies of dead workers' children


class Launch:
    """torchrun's agent, started by ``resume`` as the subreaper of what it starts."""

    def __init__(self, command: list[str]) -> None:
        was = ctypes.c_int(0)
        _prctl(PR_GET_CHILD_SUBREAPER, was)
        self._was_subreaper = was.value
        # Linux; elsewhere orphans go to init, and only the launch's own watches end them.
        self.subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self._before = frozenset(children(os.getpid()))   # not of this launch
        self.proc = subprocess.Popen(command)

    def close(self) -> None:
        if self.subreaper:
            _prctl(PR_SET_CHILD_SUBREAPER, self._was_subreaper)
            self.subreaper = False

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        else:
            for pid in self._reap():
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)

    def wait(self) -> int:
        """The agent's exit status; the orphans of dead workers are reaped meanwhile."""
        while True:
            try:
                return self.proc.wait(timeout=REAP_EVERY_S)
            except subprocess.TimeoutExpired:
                self._reap(self.proc.pid)

    def wait_for_the_rest(self, bound_s: float, say) -> list[str]:
        """Reap the launch's processes for at most ``bound_s``, then kill (each whole tree)
        and describe what is left."""
        deadline = time.monotonic() + bound_s
        if running := self._reap():
            say(f"waiting up to {bound_s:g} s for the {len(running)} process(es) of this "
                f"launch still running (pid {', '.join(map(str, running))}): they stop on "
                "their own once they see their launcher gone")
        while running and time.monotonic() < deadline:
            time.sleep(POLL_S)
            running = self._reap()
        killed = [f"pid {pid} ({command_of(pid)[:120]})" for pid in running]
        for pid in running:
            kill_tree(pid)
        if running:
            time.sleep(POLL_S)
            self._reap()
        return killed

    def _reap(self, *spare: int) -> list[int]:
        """Reap exited children (not ``spare``: Popen's), never blocking; those still running."""
        running = []
        for pid in children(os.getpid()):
            if pid in self._before or pid in spare:
                continue
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if done == 0:
                running.append(pid)
        return running


def describe_death(pid: int, returncode: int) -> str:
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"torchrun's agent (pid {pid}) died of {name}"
