"""The save pipeline: DCP saves off the training path, one at a time, committed when whole.

Every rank writes its own shard; the coordinator (rank 0) writes DCP's metadata once all
are written, then commits (``commit.py``). In ``process`` and ``thread`` mode ``save``
returns once the state is staged in host memory: call ``wait_staged`` before the optimizer
step and ``poll`` at every step.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from ...config import AsyncMode
from ...runtime.distributed import any_rank
from ..store import layout
from ..store.errors import StorageUnavailable, describe_save_error, is_transient, save_failures
from ..store.lease import Lease
from ..store.storage import Storage
from .background import start_checkpoint_process
from .commit import InFlight, NotCommitted, SaveResult, commit_written
from .dcp_planner import TrainingStatePlanner
from .staging import ReusingStager

log = logging.getLogger(__name__)


class SavePipeline:
    """Saves, commits, retires and loads checkpoints under one root."""

    def __init__(self, storage: Storage, *, mode: AsyncMode, keep_last: int,
                 is_coordinator: bool, device: torch.device, lease: Lease | None = None,
                 verify: str = "all", best: layout.BestRule | None = None) -> None:
        self.storage = storage
        self.verify = str(getattr(verify, "value", verify))  # checkpoint.verify: all|sample|none
        self.lease = lease  # the coordinator's hold on the directory; commits need it
        self.mode = AsyncMode(mode)
        self.keep_last = keep_last
        self.best = best or layout.BestRule()   # checkpoint.keep_best: kept besides keep_last
        self.is_coordinator = is_coordinator
        # One planner for the run: saves after the first reuse the cached global plan.
        self._planner = TrainingStatePlanner(enable_plan_caching=True)
        on_gpu = device.type == "cuda"
        # Pinned memory and non-blocking copies need an accelerator; shared memory lets
        # the background process read the staged tensors without a copy.
        self._stager = None if self.mode == AsyncMode.sync else ReusingStager(StagingOptions(
            use_pinned_memory=on_gpu, use_shared_memory=self.mode == AsyncMode.process,
            use_async_staging=True, use_non_blocking_copy=on_gpu), device=device)
        # A thread-mode save's collectives, on the default group, could pair up wrongly
        # across ranks with the loop's own: they get a gloo group of their own.
        self._group = (dist.new_group(backend="gloo")
                       if self.mode == AsyncMode.thread and dist.is_initialized() else None)
        self._inflight: InFlight | None = None
        self._prestaging: Future | None = None   # buffers being allocated (``prestage``)
        self._starting: Future | None = None     # the checkpoint process starting (``warm_up``)
        self._started, self._ready_by, self._start_timeout_s = False, 0.0, 0.0
        # Held by a commit in DCP's upload thread and by ``abandon``: no commit of a save
        # given up starts; one under way finishes first.
        self._commit_lock = threading.Lock()
        self.abandoned = False   # a background save was given up: it may still be running
        self.last_committed: SaveResult | None = None
        self.failed_saves = 0
        self.last_error: str | None = None
        self.broken_save = False   # a failure since the policy last looked, not an outage

    def warm_up(self, state: dict[str, Any] | None, timeout_s: float,
                process_log: str | None = None) -> str | None:
        """Start the checkpoint process (``wait_ready``: bounded by ``timeout_s`` from now)
        and fill the staging buffers (``wait_staged``). A collective; None, or why the
        start failed on this rank (the caller agrees across ranks, then saves sync)."""
        if self.mode == AsyncMode.sync:
            return None
        try:
            if self._stager is not None and state is not None:  # buffers, cached by tensor
                self._prestaging = self._stage(state)
            if self.mode == AsyncMode.process and not self._started:
                self._started = True   # once: a second start would race DCP's own
                self._starting = start_checkpoint_process(process_log)
                self._ready_by = time.perf_counter() + timeout_s
                self._start_timeout_s = timeout_s
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported, then sync
            self.abandoned = True  # a half-started process may still hold a thread
            return self.record_failure(None, exc, "the background checkpoint process did not start")
        return None

    def wait_ready(self) -> str | None:
        """Wait for the process ``warm_up`` started (bounded); None, or why it did not start."""
        starting, self._starting = self._starting, None
        if starting is None:
            return None
        try:
            starting.result(timeout=max(0.0, self._ready_by - time.perf_counter()))
            return None
        except futures.TimeoutError:
            failure: BaseException = TimeoutError(
                f"the background checkpoint process did not start within "
                f"{self._start_timeout_s:g} s (checkpoint.start_timeout_s)")
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported, then sync
            failure = exc
        self.abandoned = True   # a half-started process may still hold a thread
        return self.record_failure(None, failure, "the background checkpoint process did not start")

    def give_up_start(self) -> None:
        """No save needed the process: a start under way is left to the exit (it may hang)."""
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            self.abandoned = True

    def prestage(self, state: dict[str, Any]) -> None:
        """Allocate and fill the staging buffers in the background (``warm_up`` could not)."""
        if self._stager is None or self._inflight is not None or self._prestaging is not None:
            return
        self._prestaging = self._stage(state)

    def _stage(self, state: dict[str, Any]) -> Future | None:
        """Copy ``state`` into the staging buffers; the copy's Future if in the background."""
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        staged = self._stager.stage(plain)
        return staged if isinstance(staged, Future) else None

    def prepare(self) -> None:
        """Create the root and clean what an interrupted earlier run left behind."""
        if self.is_coordinator:
            self.storage.makedirs()
            for name in layout.clean_leftovers(self.storage):
                log.info("removed unfinished %s", self.storage.path(name))

    def newest(self) -> layout.Committed | None:
        return layout.newest_complete_checkpoint(self.storage, verify=self.verify)

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def in_flight_s(self) -> float:
        """Seconds since the save in flight started (0.0 with none)."""
        return time.perf_counter() - self._inflight.started if self._inflight is not None else 0.0

    @property
    def in_flight_step(self) -> int | None:
        return self._inflight.step if self._inflight is not None else None

    def save(self, step: int, state: dict[str, Any], reason: str, record: dict[str, Any],
             *, blocking: bool = False) -> SaveResult | None:
        """Start a save of ``state`` at ``step``; never two at once (``wait`` first: the
        staging buffers are reused). Async modes return None once the state is handed over
        (``poll``/``wait`` commit it); ``blocking`` (the last save before exiting: the
        background process may be gone) writes synchronously and returns the result."""
        if self._inflight is not None:
            raise RuntimeError(f"the save of step {self._inflight.step} is still in flight; "
                               "wait for it before starting another")
        started = time.perf_counter()
        self.wait_staged()  # a prestage still copying into the buffers
        prepared: BaseException | None = None
        if self.is_coordinator:
            try:
                layout.make_room(self.storage, step)
            except Exception as exc:  # noqa: BLE001 - agreed below, then raised on every rank
                prepared = exc
        # Every rank learns the coordinator failed, or the others would wait in DCP alone.
        failed, unreachable = any_rank(prepared is not None,
                                       prepared is not None and is_transient(prepared))
        if failed:
            raise prepared or (StorageUnavailable if unreachable else OSError)(
                f"the coordinator could not prepare the save of step {step} in "
                f"{self.storage.path('')}")
        handed_off = time.perf_counter()
        writer = self.storage.writer(layout.staging_name(step, self.storage))
        if blocking or self.mode == AsyncMode.sync:
            metadata = dcp.save(state, storage_writer=writer, planner=self._planner)
            written, upload = time.perf_counter(), Future()
            upload.set_result(None)   # written already
            self._inflight = InFlight(step, reason, record, started, written - started, upload,
                                       None, handed_off, written, metadata=metadata)
            return self._finish(mode=AsyncMode.sync)
        kind = (AsyncCheckpointerType.PROCESS if self.mode == AsyncMode.process
                else AsyncCheckpointerType.THREAD)
        # The staged state is on the host: no copy-ahead (DCP's writer.stage() would set it,
        # but is skipped with a stager; the overlapping loader would open a CUDA context on
        # GPU 0 in the background process and queue writes behind training kernels).
        if hasattr(writer, "per_thread_copy_ahead"):
            writer.per_thread_copy_ahead = 0
        response = dcp.async_save(state, storage_writer=writer, planner=self._planner,
                                  async_checkpointer_type=kind, async_stager=self._stager,
                                  process_group=self._group)
        upload, staging = ((response.upload_completion, response.staging_completion)
                           if isinstance(response, AsyncSaveResponse) else (response, None))
        inflight = InFlight(step, reason, record, started, time.perf_counter() - started,
                             upload, staging, handed_off)
        if self.is_coordinator:
            inflight.committed = Future()
            upload.add_done_callback(lambda done: self._commit_when_written(inflight, done))
        else:
            upload.add_done_callback(lambda _: setattr(inflight, "written", time.perf_counter()))
        self._inflight = inflight
        return None

    def wait_staged(self) -> None:
        """Block until the in-flight save has copied the state (before parameters change)."""
        if self._prestaging is not None:
            futures.wait([self._prestaging])   # a failure shows again at the first save
            self._prestaging = None
        inflight = self._inflight
        if inflight is not None and inflight.staging is not None:
            began = time.perf_counter()
            futures.wait([inflight.staging])  # a failed staging surfaces through the upload
            inflight.blocking_s += time.perf_counter() - began
            inflight.staging = None

    def poll(self) -> SaveResult | None:
        """Commit the in-flight save if it has finished; never blocks."""
        inflight = self._inflight
        if inflight is not None and all(f.done() for f in self._finishing(inflight)):
            return self._finish()
        return None

    @staticmethod
    def _finishing(inflight: InFlight) -> list[Future]:
        """What must be done before a save can be handed over: staging, upload, commit."""
        return [f for f in (inflight.staging, inflight.upload, inflight.committed) if f is not None]

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the in-flight save (if any) is written, then commit it; with
        ``timeout`` (s), TimeoutError if not written by then (it stays in flight)."""
        if self._inflight is None:
            return None
        if timeout is not None:
            _, not_done = futures.wait(self._finishing(self._inflight), timeout=max(0.0, timeout))
            if not_done:
                raise TimeoutError(f"the save of step {self._inflight.step} was not written "
                                   f"within {max(0.0, timeout):.1f} s")
        self.wait_staged()
        futures.wait(self._finishing(self._inflight))  # errors are reported by _finish
        return self._finish()

    def abandon(self, why: str = "") -> int | None:
        """Forget the in-flight save uncommitted (``prepare`` removes it at the next start;
        a writer may still run); its step, or None when a commit under way in the upload
        thread finished first (it is ``last_committed`` then)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        with self._commit_lock:
            inflight.given_up = True
        committed = inflight.committed
        if committed is not None and committed.done() and committed.exception() is None:
            self.last_committed = committed.result()
            return None
        self.abandoned = True
        self.record_failure(inflight.step, None,
                            "given up unfinished" + (f": {why}" if why else ""))
        return inflight.step

    def record_failure(self, step: int | None, exc: BaseException | None, what: str) -> str:
        """Count a failed save and say why, naming the checkpoint root; returns the sentence."""
        detail = describe_save_error(exc, self.storage.path("")) if exc is not None else ""
        where = f"checkpoint of step {step}" if step is not None else "checkpointing"
        sentence = (f"{where} in {self.storage} {what}" + (f" ({detail})" if detail else "")
                    + "; the previous checkpoint stays the newest")
        self.failed_saves += 1
        self.last_error = sentence
        # Anything but unreachable storage may mean a broken checkpoint process (policy.py).
        self.broken_save |= exc is None or not all(map(is_transient, save_failures(exc)))
        log.error("%s", sentence)
        return sentence

    def _finish(self, mode: AsyncMode | None = None) -> SaveResult | None:
        inflight, self._inflight = self._inflight, None
        try:
            inflight.upload.result(timeout=0)
        # A failed save must not end training: the previous checkpoint stays usable.
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            self.record_failure(inflight.step, exc, "failed")
            return None
        if not self.is_coordinator:
            return None
        try:
            result = (inflight.committed.result(timeout=0) if inflight.committed is not None
                      else self._commit(inflight, mode))
        except NotCommitted as exc:
            self.record_failure(inflight.step, exc.__cause__, str(exc))
            return None
        self.last_committed = result
        return result

    def _commit_when_written(self, inflight: InFlight, upload: Future) -> None:
        """In DCP's upload thread (coordinator): commits off the training thread for ``poll``."""
        inflight.written = time.perf_counter()
        try:
            with self._commit_lock:
                if inflight.given_up:
                    inflight.committed.set_exception(NotCommitted("was given up"))
                elif upload.exception() is None:
                    inflight.metadata = upload.result()
                    inflight.committed.set_result(self._commit(inflight, None))
                else:
                    inflight.committed.set_exception(NotCommitted("was not written"))
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            inflight.committed.set_exception(exc)

    def _commit(self, inflight: InFlight, mode: AsyncMode | None) -> SaveResult:
        return commit_written(inflight, self.storage, mode or self.mode, self.lease,
                              self.keep_last, self.best)

    def close(self) -> SaveResult | None:
        """Finish the in-flight save and release the staging buffers."""
        result = self.wait()
        # An abandoned writer may still read the buffers: left to the process exit.
        if self._stager is not None and not self.abandoned:
            self._stager.close()
        self._stager = None
        return result
