"""A worker forked from the zygote (``launch/zygote.py``), both halves of the hand-over.

``start_if_asked()`` (the process torchrun started, before heavy imports; standard library
only) hands its command line, environment and streams to the zygote and stands in for the
forked worker, or returns and the worker starts cold. ``become_worker()`` (the forked
child) runs ``train``. The design: docs/RECOVERY.md ("Warm start").
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time

from .. import PACKAGE
from ..preemption import early
from ..runtime.lifeline import TORCHRUN_ENV
from ..runtime.process_tree import alive

ZYGOTE_ENV = f"{PACKAGE.upper()}_ZYGOTE"   # the zygote's socket, set by the agent
FORK_WAIT_S = 60.0      # the zygote (still importing, perhaps) forks within this, or: cold
ORPHAN_WAIT_S = 600.0   # the zygote gone: the worker stops on its own within this
CHECKPOINT_PROCESS_NAME = "checkpoint-{rank}"   # a forked checkpoint process's name (comm)
RELAYED = tuple(getattr(signal, name) for name in
                ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"))


def start_if_asked() -> None:
    """Run this worker as a fork of the zygote and exit with its status, or return (cold)."""
    if not (path := os.environ.get(ZYGOTE_ENV)):
        return
    try:
        conn = _ask(path)
        first = _Lines(conn).next(FORK_WAIT_S)
    except (OSError, ValueError) as exc:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"warm start: the zygote does not answer ({exc}): workers start cold",
                  file=sys.stderr, flush=True)
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
    def relay(signum: int, _frame) -> None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signum)

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
        elif not alive(pid):
            break
        else:
            time.sleep(0.25)
    else:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    if fd is not None:
        os.close(fd)


class _Lines:
    """JSON lines from the zygote, each read within a bound (None: no bound)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""

    def next(self, bound_s: float | None) -> dict:
        self.conn.settimeout(bound_s)
        while b"\n" not in self.buffer:
            if not (chunk := self.conn.recv(4096)):
                raise ValueError("the zygote hung up")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


# ------------------------------------------------------------- in the child --
def become_worker(conn: socket.socket, request: dict, zygote: str) -> int:
    """Take the request's cwd, environment and argv, tell it this pid, run ``train``; its status."""
    _take(request)
    sys.argv = list(request["argv"])
    from ..checkpoint.save.background import fork_from

    early.hold()
    why_not = fork_from(lambda fds: _fork_checkpoint_process(zygote, fds))
    if why_not is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warm start: {why_not}: DCP spawns its checkpoint process", file=sys.stderr)
    conn.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
    conn.close()
    return run_as_main(f"{PACKAGE}.train")


def become_checkpoint_process(conn: socket.socket, request: dict, pipe_fd: int) -> int:
    """Serve as the worker's DCP checkpoint process on ``pipe_fd`` until it ends or is gone."""
    _take(request)
    _end_with(int(request["worker"]))
    # What ps and top show: this is the checkpoint process of that rank.
    with contextlib.suppress(OSError), open("/proc/self/comm", "w", encoding="ascii") as comm:
        comm.write(CHECKPOINT_PROCESS_NAME.format(rank=os.environ.get("RANK", "")))
    conn.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
    conn.close()
    from ..checkpoint.save.background import serve_as_checkpoint_process

    serve_as_checkpoint_process(pipe_fd)
    return 0


def _end_with(pid: int) -> None:
    def wait() -> None:
        try:
            select.select([os.pidfd_open(pid)], [], [])
        except ProcessLookupError:
            pass
        except (OSError, AttributeError):   # no pidfd: look every second
            while alive(pid):
                time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=wait, name="worker-watch", daemon=True).start()


def _take(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.pop(ZYGOTE_ENV, None)   # what runs here asks no zygote
    _as_a_new_process()


def _fork_checkpoint_process(zygote: str, fds: list[int]) -> Forked:
    """In a worker: its DCP checkpoint process, forked by the zygote on ``fds``, or OSError."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(FORK_WAIT_S)
        conn.connect(zygote)
        request = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(),
                              "worker": os.getpid()}).encode()
        socket.send_fds(conn, [b"C"], fds)
        conn.sendall(len(request).to_bytes(4, "big") + request)
        lines = _Lines(conn)
        first = lines.next(FORK_WAIT_S)
    except (OSError, ValueError) as exc:
        conn.close()
        raise OSError(f"the zygote does not answer ({exc})") from exc
    if "pid" not in first:
        conn.close()
        raise OSError(first.get("refused", "refused"))
    # This open socket keeps the child alive (the zygote kills it at hang-up): forks close it.
    os.register_at_fork(after_in_child=conn.close)
    return Forked(int(first["pid"]), lines)


class Forked:
    """A process the zygote forked for this worker, as a ``multiprocessing.Process``."""

    def __init__(self, pid: int, lines: _Lines) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self._lines = lines

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None:
            return
        try:
            done = self._lines.next(timeout)
        except (BlockingIOError, TimeoutError):
            return
        except (OSError, ValueError):
            done = {}   # the zygote hung up without a word: it is gone, and so is this
        self.exitcode = int(done.get("exit", -signal.SIGKILL))
        self._lines.conn.close()

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None

    def terminate(self) -> None:
        if self.is_alive():
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.is_alive():
            os.kill(self.pid, signal.SIGKILL)


def _as_a_new_process() -> None:
    """torch's thread count and a NumPy RNG of its own, as a new process would have
    (Python's ``random`` reseeds itself at a fork)."""
    import numpy
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy.random.seed()


def run_as_main(module: str) -> int:
    """``python -m module`` in this process, with the interpreter's exit; its status."""
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
        if (shutdown := getattr(threading, "_shutdown", None)) is not None:
            shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    return code


def _status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
