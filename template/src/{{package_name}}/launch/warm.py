"""A worker forked from the zygote (``launch/zygote.py``), both halves of the hand-over.

- ``start_if_asked()``, in the process torchrun started (``train.py``, before its heavy
  imports): it sends its command line, environment and standard streams to the zygote,
  then stands in for the forked worker: signals passed on to it, its exit status its own.
  Without a zygote, or refused by it, it returns and the worker starts cold.
- ``become_worker()``, in the forked child: takes that environment and runs ``train``.

Standard library only on the first side. docs/RECOVERY.md ("Warm start") has the design.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time

from .. import PACKAGE
from ..runtime.lifeline import TORCHRUN_ENV

ZYGOTE_ENV = f"{PACKAGE.upper()}_ZYGOTE"   # the zygote's socket, set by the agent
FORK_WAIT_S = 60.0      # the zygote (still importing, perhaps) forks within this, or: cold
ORPHAN_WAIT_S = 600.0   # the zygote gone: the worker stops on its own within this
RELAYED = tuple(getattr(signal, name) for name in
                ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"))


def start_if_asked() -> None:
    """Run this worker as a fork of the zygote and exit with its status; return when
    there is no zygote to ask or it refused (the worker then starts cold)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        return
    try:
        conn = _ask(path)
        first = _Lines(conn).next(FORK_WAIT_S)
    except (OSError, ValueError) as exc:
        _say_cold(f"the zygote does not answer ({exc})")
        return
    if "pid" not in first:
        return   # refused: the zygote said why, once
    sys.exit(_stand_in(conn, int(first["pid"])))


def _ask(path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(FORK_WAIT_S)
    conn.connect(path)
    env = {**os.environ, TORCHRUN_ENV: str(os.getppid())}   # whom to ask to stop
    request = json.dumps({"argv": sys.argv, "env": env, "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [b"F"], [0, 1, 2])
    conn.sendall(len(request).to_bytes(4, "big") + request)
    return conn


def _stand_in(conn: socket.socket, pid: int) -> int:
    """Pass stop signals on to the worker's process group until it exits; its status."""
    from ..preemption import early

    def relay(signum: int, _frame) -> None:
        try:
            os.killpg(pid, signum)
        except OSError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    for sig in early.take(RELAYED):
        relay(sig, None)
    try:
        done = _Lines(conn).next(None)
    except (OSError, ValueError):
        done = {}
    if "exit" not in done:   # the zygote died: the worker ends on its own (it watches it)
        _wait_gone(pid, ORPHAN_WAIT_S)
        return 1
    code = int(done["exit"])
    if code < 0:   # died of a signal: so does this process, as torchrun expects
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code


def _wait_gone(pid: int, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = None
    while time.monotonic() < deadline:
        if fd is not None:
            if select.select([fd], [], [], 1.0)[0]:
                break
        else:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.25)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    if fd is not None:
        os.close(fd)


def _say_cold(reason: str) -> None:
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warm start: {reason}: workers start cold", file=sys.stderr, flush=True)


class _Lines:
    """JSON lines from the zygote, each read within a bound (None: no bound)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""

    def next(self, bound_s: float | None) -> dict:
        self.conn.settimeout(bound_s)
        while b"\n" not in self.buffer:
            try:
                chunk = self.conn.recv(4096)
            except InterruptedError:
                continue
            if not chunk:
                raise ValueError("the zygote hung up")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


# ------------------------------------------------------------- in the child --
def become_worker(conn: socket.socket, request: dict) -> int:
    """Take the requester's directory, environment and command line, tell it this pid
    (once its stop signals are held), run ``train`` as ``__main__``; the exit status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.pop(ZYGOTE_ENV, None)   # train, run below, asks no zygote
    _as_a_new_process()
    sys.argv = list(request["argv"])
    from ..preemption import early

    early.hold()
    conn.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
    conn.close()
    return run_as_main(f"{PACKAGE}.train")


def _as_a_new_process() -> None:
    """What a new process would have taken from its environment: torch's thread count,
    and a global NumPy RNG of its own (Python's ``random`` reseeds itself at a fork)."""
    import numpy
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy.random.seed()


def run_as_main(module: str) -> int:
    """``python -m module`` in this process: its exit status, after what an interpreter
    does at exit (non-daemon threads joined, atexit functions run, streams flushed)."""
    import atexit
    import runpy
    import threading

    code = 0
    sys.modules.pop(module, None)   # imported by the zygote: run anew, as __main__
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _status(exc.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


def _status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
