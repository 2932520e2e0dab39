"""The zygote: one process that has imported torch and the train module, forking workers.

    python -u -m <package>.launch.zygote --fd N --parent PID

Started by ``resume`` or the agent; every worker torchrun starts asks it for a fork
(``launch/warm.py``), so a start or an in-place restart pays no import. The design:
docs/RECOVERY.md ("Warm start").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from .. import PACKAGE
from ..runtime.lifeline import die_with_parent, say_if_heard
from ..runtime.process_tree import alive

READY_PREFIX = "warm start:"
# A request's first byte: fork a worker, or its DCP checkpoint process, or end with this
# process; the descriptors sent with each: standard streams (after the checkpoint pipe).
FORK, CHECKPOINT, WATCH = b"F", b"C", b"W"
DESCRIPTORS = {FORK: 3, CHECKPOINT: 4, WATCH: 0}
REQUEST_TIMEOUT_S = 10.0   # a worker's request, once connected, arrives within this
MAX_REQUEST_BYTES = 1 << 22


def say(line: str) -> None:
    say_if_heard(f"{READY_PREFIX} {line}")


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


# What every worker imports, in order. The first two start their libraries' own thread
# pools (which stop and restart around a fork); FSDP2 imports torch._dynamo at its first call.
LIBRARIES = ("numpy", "torch")
PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
           f"{PACKAGE}.train", f"{PACKAGE}.task")


def preload() -> int:
    """Import ``LIBRARIES`` and ``PRELOAD``; the OS threads counted between the two."""
    for name in LIBRARIES:
        importlib.import_module(name)
    baseline = _threads()
    for name in PRELOAD:
        importlib.import_module(name)
    return baseline


def fork_hazard(baseline_threads: int) -> str | None:
    """Why a fork of this process would not be a sound worker, or None."""
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialised at import (a forked child could not use it)"
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate()
                          if t is not threading.main_thread())
        return f"a Python thread was started at import ({names})"
    if _threads() > baseline_threads:
        return (f"{_threads() - baseline_threads} native thread(s) were started at import")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "a process group exists"
    return None


class Zygote:
    """The serving loop: accept a worker's request, fork, report the child's exit."""

    def __init__(self, listener: socket.socket, baseline_threads: int) -> None:
        self.listener = listener
        self.path = listener.getsockname()
        self.baseline = baseline_threads
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}   # child pid -> the requester's socket
        self.refused: str | None = None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")

    def serve(self, parent: int) -> None:
        while os.getppid() == parent:
            for key, _ in self.selector.select(timeout=0.5):
                if key.data == "accept":
                    self._accept()
                elif key.data == "watched":
                    return
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 512)
                    self._reap()
                else:   # a requester's socket: readable means it is gone (EOF)
                    self._requester_gone(key.data, key.fileobj)
            self._reap()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            kind, request, fds = _receive(conn)
        except (OSError, ValueError) as exc:
            say(f"a worker's request could not be read ({exc})")
            conn.close()
            return
        if kind == WATCH:
            self._watch(int(request["pid"]))
            conn.close()
            return
        if (hazard := self.refused or fork_hazard(self.baseline)) is not None:
            if self.refused is None:
                self.refused = hazard
                say(f"refused: {hazard}: workers start cold")
            for fd in fds:
                os.close(fd)
            _send(conn, {"refused": hazard})
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()   # the child's collections leave the shared objects' pages alone
        pid = os.fork()
        if pid == 0:
            self._become(kind, conn, request, fds)   # never returns
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _watch(self, pid: int) -> None:
        """End the zygote when ``pid`` (the agent) ends: its workers see their parent gone."""
        try:
            self.selector.register(os.pidfd_open(pid), selectors.EVENT_READ, "watched")
        except (OSError, AttributeError):
            if not alive(pid):
                os._exit(0)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if (conn := self.children.pop(pid, None)) is None:
                continue
            self._forget(conn)
            with contextlib.suppress(OSError):
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()

    def _requester_gone(self, pid: int, conn: socket.socket) -> None:
        """The worker's launcher-side process ended (killed): its child goes too."""
        try:
            if conn.recv(1):
                return   # not expected; nothing to do
        except OSError:
            pass
        self._forget(conn)   # the child stays in ``children``, to be reaped
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)

    def _forget(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):   # its requester went first
            self.selector.unregister(conn)

    def _become(self, kind: bytes, conn: socket.socket, request: dict,
                fds: list[int]) -> None:
        """In the forked child: become the worker (or its checkpoint process), run it, exit."""
        code = 1
        try:
            gc.enable()
            os.setsid()   # its own process group, as torchrun starts workers
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.selector.close()
            for closing in (self.listener, *self.children.values()):
                closing.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for target, fd in enumerate(fds[-3:]):
                os.dup2(fd, target)
                os.close(fd)
            from .warm import become_checkpoint_process, become_worker

            if kind == CHECKPOINT:   # outlives this process: it ends with its worker
                code = become_checkpoint_process(conn, request, fds[0])
            else:
                code = become_worker(conn, request, self.path)
        except BaseException:   # noqa: BLE001 - a child must never return into the loop
            traceback.print_exc()
        finally:
            os._exit(code)


def _receive(conn: socket.socket) -> tuple[bytes, dict, list[int]]:
    conn.settimeout(REQUEST_TIMEOUT_S)
    kind, fds, _, _ = socket.recv_fds(conn, 1, max(DESCRIPTORS.values()))
    if len(fds) != DESCRIPTORS.get(kind, -1):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a request {kind!r} with {len(fds)} file descriptors")
    size = int.from_bytes(_exactly(conn, 4), "big")
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {size} bytes")
    request = json.loads(_exactly(conn, size))
    conn.settimeout(None)
    return kind, request, fds


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        if not (chunk := conn.recv(size - len(data))):
            raise ValueError("the worker hung up")
        data += chunk
    return data


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


class Started:
    """The handle on a zygote, started before torch is imported; ``stop`` is bounded."""

    STOP_S = 5.0

    def __init__(self, nproc_per_node: str | None) -> None:
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.path = os.path.join(self.folder, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        env = dict(os.environ)
        # As torchrun sets it for several workers: the libraries size their thread pools by it.
        if (nproc_per_node or "1").isdigit() and int(nproc_per_node or "1") > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", f"{PACKAGE}.launch.zygote",
             f"--fd={listener.fileno()}", f"--parent={os.getpid()}"],
            pass_fds=[listener.fileno()], env=env)
        listener.close()   # the zygote's now: once it is gone, workers are refused at once

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def ahead(argv: list[str]) -> Started | None:
    """In ``resume``, before its imports: a zygote for the launch, unless the command line
    rules one out (a config file's ``recovery.warm_start: false`` stops it later)."""
    if {"--dry-run", "-h", "--help"} & set(argv) or "recovery.warm_start=false" in argv:
        return None
    nproc = next((argv[i + 1] for i, a in enumerate(argv[:-1])
                  if a in ("--nproc-per-node", "--nproc_per_node")), None)
    nproc = next((a.split("=", 1)[1] for a in argv
                  if a.startswith(("--nproc-per-node=", "--nproc_per_node="))), nproc)
    try:
        return Started(nproc)
    except OSError:
        return None   # the agent starts one itself


def watch_me(path: str) -> None:
    """In the agent, for a zygote ``resume`` started: end it when this process ends."""
    # An OSError: the zygote is gone already, and the workers start cold and say so.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, contextlib.suppress(OSError):
        conn.settimeout(REQUEST_TIMEOUT_S)
        conn.connect(path)
        request = json.dumps({"pid": os.getpid()}).encode()
        conn.sendall(WATCH + len(request).to_bytes(4, "big") + request)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.launch.zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    # At once: clean-up of torch's modules takes seconds, in which workers would not see it gone.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    listener = socket.socket(fileno=args.fd)
    gc.disable()   # no freed holes in the pages a fork shares (Python's gc docs)
    began = time.monotonic()
    try:
        baseline = preload()
    except Exception as exc:  # noqa: BLE001 - the workers start cold and show it whole
        say(f"the zygote could not import the train module ({type(exc).__name__}: "
            f"{exc}): workers start cold")
        return 1
    if os.environ.get(f"{PACKAGE.upper()}_WARM_VERBOSE"):
        say(f"zygote {os.getpid()} ready in {time.monotonic() - began:.2f} s")
    Zygote(listener, baseline).serve(args.parent)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
