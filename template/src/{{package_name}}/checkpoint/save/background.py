"""DCP's background checkpoint process: started before the first step, ended at exit.

DCP starts it at the first ``async_save``; a tiny save starts it at start-up instead,
where a failure costs a bounded wait, while the first steps train (the first save waits:
``SavePipeline.wait_ready``). A warm-started worker has it forked from the zygote
(``fork_from``). docs/RECOVERY.md ("Warm start").
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from ...runtime.distributed import decide_on_rank0
from ...runtime.output_dirs import make_output_dir

SPAWN_WAIT_S = 30.0   # how long the log redirection waits for the process to be spawned

# A forked checkpoint process (``fork_from``): who forks it, and the ones forked so far.
_forker: Callable[[list[int]], Any] | None = None
_forked: list[Any] = []
_fork_asked = threading.Event()


def start_checkpoint_process(process_log: str | None) -> futures.Future:
    """One tiny save through DCP's process checkpointer spawns its process and group (a
    collective); returns once spawned, with the save's Future (done once the process is up)."""
    name = decide_on_rank0(lambda: f"dcp-start-{uuid.uuid4().hex}")
    scratch = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(scratch, exist_ok=True)
    before = set(multiprocessing.active_children())
    try:
        with stderr_to(process_log):   # the child's standard error is fixed at its spawn
            response = dcp.async_save({"start": torch.zeros(1)},
                                      storage_writer=dcp.FileSystemWriter(scratch),
                                      planner=_StartPlanner(),
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            upload = (response.upload_completion if isinstance(response, AsyncSaveResponse)
                      else response)
            deadline = time.monotonic() + SPAWN_WAIT_S
            while (not set(multiprocessing.active_children()) - before and not upload.done()
                   and not _fork_asked.is_set() and time.monotonic() < deadline):
                time.sleep(0.005)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    upload.add_done_callback(lambda _: shutil.rmtree(scratch, ignore_errors=True))
    return upload


@contextlib.contextmanager
def stderr_to(path: str | None):
    """Point file descriptor 2 at ``path`` while a child process is started (its logs)."""
    if path is None:
        yield
        return
    make_output_dir(os.path.dirname(path) or ".")   # log.dir
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


class _StartPlanner(dcp.DefaultSavePlanner):
    """A class of its own: DCP caches one plan per class, so the training state's stays."""


def stop_background_processes() -> None:
    """End DCP's checkpoint process (and any other child) before an ``os._exit`` (an
    abandoned save's thread may wait on a dead peer for half an hour)."""
    for child in [*multiprocessing.active_children(), *_forked]:
        child.terminate()
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


def fork_from(forker: Callable[[list[int]], Any]) -> str | None:
    """Have DCP's checkpoint process forked by ``forker`` instead of spawned; None, or why
    not (this torch's DCP lacks the shape relied on: it then spawns). ``forker(fds)`` (its
    pipe end, then its standard streams) forks one to run ``serve_as_checkpoint_process``
    and returns a handle like a ``multiprocessing.Process`` (``pid``, ``is_alive``, ``join``,
    ``terminate``, ``kill``, ``exitcode``), or raises OSError (DCP then spawns it)."""
    global _forker
    from torch.distributed.checkpoint import _async_process_executor as executor

    base = getattr(executor, "_AsyncCheckpointProcess", None)
    if (base is None or not callable(getattr(base, "_checkpointing_subprocess", None))
            or list(inspect.signature(base.__init__).parameters) != ["self", "pg_init_info"]):
        return "this torch's DCP has no _AsyncCheckpointProcess(pg_init_info) to fork"
    if not getattr(base, "forked", False):
        executor._AsyncCheckpointProcess = type("ForkedCheckpointProcess", (base,), {
            "__init__": _forked_init, "forked": True, "__module__": __name__})
    _forker = forker
    return None


def _forked_init(self, pg_init_info) -> None:
    """``_AsyncCheckpointProcess.__init__`` with the process forked by ``_forker``."""
    from torch.distributed.checkpoint._async_process_executor import (
        _CheckpointSaveProcessControlOpts as Control,
    )

    ours, theirs = multiprocessing.Pipe()
    try:
        if _forker is None:
            raise OSError("no forker")
        child = _forker([theirs.fileno(), 0, 1, 2])
    except OSError:
        ours.close()
        super(type(self), self).__init__(pg_init_info)   # spawned, as DCP does
        return
    finally:
        theirs.close()
    _forked.append(child)
    _fork_asked.set()
    self.ctx = multiprocessing.get_context("spawn")
    self._process_pipe = ours
    self._save_process = child
    ours.send(pg_init_info)
    response = self._wait_for_response(timeout=1800)   # DCP's own bound for its start
    if response != Control.INIT_COMPLETE:
        raise AssertionError(f"Expected INIT_COMPLETE response, got {response}")


def serve_as_checkpoint_process(pipe_fd: int) -> None:
    """In a forked checkpoint process: DCP's own serving loop on the pipe ``pipe_fd``."""
    from multiprocessing.connection import Connection

    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    conn = Connection(pipe_fd)
    try:
        pg_init_info = conn.recv()
    except EOFError:
        return   # the worker went before it told this process where its peers meet
    _AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, conn)


def quiet_checkpoint_process_exit() -> None:
    """No traceback at exit for a checkpoint process already gone (torchrun's SIGTERM kills
    it too): drops only DCP's finalizer's OSError or EOFError as it writes to it."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        where = getattr(unraisable.object, "__qualname__", "")
        if (where == "_AsyncCheckpointProcess.__del__"
                and isinstance(unraisable.exc_value, (OSError, EOFError))):
            return
        previous(unraisable)

    sys.unraisablehook = hook
