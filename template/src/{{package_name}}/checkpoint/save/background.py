"""DCP's background checkpoint process: started before the first step, ended at exit.

DCP starts its process checkpointer at the first ``async_save``; a tiny save of its own
(with a planner class of its own, so the training state's cached plan stays) starts it
at start-up instead, where a failure costs a bounded wait. Training does not wait for
it: ``start_checkpoint_process`` returns once the process is spawned (its log lines,
INFO to its standard error, go to a file), and the first save waits for it to be up
(``SavePipeline.wait_ready``). The process (a new Python importing torch: 1.5 to 2
s on a 2-core machine) starts while the first steps train.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent import futures

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from ...runtime.distributed import decide_on_rank0
from ...runtime.output_dirs import make_output_dir

SPAWN_WAIT_S = 30.0   # how long the log redirection waits for the process to be spawned


def start_checkpoint_process(process_log: str | None) -> futures.Future:
    """One tiny save through DCP's process checkpointer spawns its process and group.

    A collective (DCP agrees on the process group's port on the calling thread). Returns
    once the process is spawned, with the save's Future: done when the process is up and
    has written the tiny save. Its scratch directory goes when the Future is done.
    """
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
                   and time.monotonic() < deadline):
                time.sleep(0.005)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    upload.add_done_callback(lambda _: shutil.rmtree(scratch, ignore_errors=True))
    return upload


@contextlib.contextmanager
def stderr_to(path: str | None):
    """Point file descriptor 2 at ``path`` while a child process is started, so that the
    child's own log lines go to that file and not to the console."""
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
    """The start-up save's own planner class: DCP caches plans per class, so the tiny
    start-up save does not take the training state's cache slot."""


def stop_background_processes() -> None:
    """End DCP's checkpoint process (and any other child) without waiting for it.

    After a background save was abandoned its thread may wait on a dead peer for half an
    hour; the caller then leaves with ``os._exit`` and must not leave children behind.
    """
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


def quiet_checkpoint_process_exit() -> None:
    """No traceback at exit for a checkpoint process that is already gone.

    torchrun's SIGTERM reaches the worker's whole process group, DCP's checkpoint process
    included; at interpreter exit DCP's finalizer then writes to the dead process and
    Python prints the ignored BrokenPipeError with a traceback, after a clean stop. This
    drops exactly that one (an OSError or EOFError from that finalizer); every other
    unraisable exception is printed as before.
    """
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        where = getattr(unraisable.object, "__qualname__", "")
        if (where == "_AsyncCheckpointProcess.__del__"
                and isinstance(unraisable.exc_value, (OSError, EOFError))):
            return
        previous(unraisable)

    sys.unraisablehook = hook
