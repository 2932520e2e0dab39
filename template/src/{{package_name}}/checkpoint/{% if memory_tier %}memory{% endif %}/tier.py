"""The memory tier: a copy of the training state every ``checkpoint.memory_interval_steps``
in RAM of its node and of a partner node, and a start from the nearest complete copy.

At a step boundary the loop waits for one copy of the state into a slot (``save``); the
tier's thread then commits it and sends it to the partner (``partners.py``) while
training goes on. A round starts only once every rank's previous round is over (one
flag, agreed), so two slots always keep one complete copy every rank has. A start
(``restore``) takes the newest step every rank has in memory, on its node or its
partner's, when it is not older than the newest durable checkpoint; every rank checks
its copy before any rank loads, and a copy that fails anywhere falls back to durable
storage. Only a start that continues a run uses copies; they are freed once the job
ends with its final state durable. Why and when: docs/RECOVERY.md, "The memory tier".
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ...config import Config
from ...runtime import phases
from ...runtime.distributed import Runtime, any_rank
from ...runtime.metrics import Event, MetricsLog
from ...runtime.phases import Phase
from ..store.layout import Committed
from .copies import (
    DATA,
    SKELETON,
    Copy,
    MemoryCopyError,
    Slot,
    encode,
    flatten,
    free,
    inventory,
    newest_copy,
    run_folder,
    slots_of,
    table_of_size,
)
from .partners import Partners, Receipt, Sending, gather_identities
from .reading import Opened, apply, fit

log = logging.getLogger(__name__)


class MemoryTierUnusable(ValueError):
    """checkpoint.memory_dir cannot hold the copies (exit status 2)."""


@dataclass
class Round:
    """What one memory save measured (rank 0 logs it as a ``memory_save`` event)."""

    step: int
    stall_s: float
    bytes: int
    commit_s: float = 0.0
    replicate_s: float = 0.0
    error: str | None = None


class MemoryTier:
    def __init__(self, cfg: Config, runtime: Runtime, metrics: MetricsLog, folder: Path,
                 partners: Partners, group: Any) -> None:
        self.interval = cfg.checkpoint.memory_interval_steps
        self.timeout_s = cfg.checkpoint.wait_timeout_s
        self.verify = str(getattr(cfg.checkpoint.verify, "value", cfg.checkpoint.verify))
        self.runtime, self.metrics, self.folder = runtime, metrics, folder
        self.partners, self.group = partners, group
        self.rank = runtime.rank
        self._slots: dict[int, list[Slot]] = {}
        self._newest: dict[int, Slot] = {}   # the slot of each rank's newest complete copy
        self._check: _Check | None = None     # this rank's newest copy, checked at a start
        # One worker thread for the rounds, started with the first; ``_idle`` is set
        # while no round is under way.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None
        self.rounds: list[Round] = []
        self.skipped = 0

    # ------------------------------------------------------------------ start --
    @classmethod
    def open(cls, cfg: Config, runtime: Runtime, metrics: MetricsLog, *,
             continues: bool) -> MemoryTier | None:
        """The tier of this job, or None when checkpoint.memory_interval_steps is 0 (every
        rank calls this). A start that does not continue a run clears the node's copies
        of this checkpoint.dir."""
        ckpt = cfg.checkpoint
        if ckpt.memory_interval_steps == 0:
            return None
        folder = run_folder(ckpt.memory_dir, ckpt.dir)
        if not continues and runtime.local_rank == 0:
            free(folder)
        any_rank(False)   # cleared before any rank of the node writes there
        error = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".probe-{runtime.rank}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            error = (f"checkpoint.memory_dir={ckpt.memory_dir} cannot hold the memory copies "
                     f"({exc.strerror or exc}); use a writable tmpfs such as /dev/shm or set "
                     "checkpoint.memory_interval_steps=0")
        (failed,) = any_rank(error is not None)
        if failed:
            raise MemoryTierUnusable(error or "checkpoint.memory_dir cannot hold the memory "
                                     "copies on another rank")
        partners = Partners.of(gather_identities(ckpt.memory_dir))
        group = None
        if partners.nodes > 1:   # the tier's own group: its thread never meets training's
            group = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=ckpt.wait_timeout_s))
        tier = cls(cfg, runtime, metrics, folder, partners, group)
        if continues:   # check this rank's newest copy while the model is built
            tier.start_check()
        return tier

    def start_check(self) -> None:
        """Open and check this rank's newest copy on this node in a thread: a restart
        builds its model meanwhile, and ``restore`` finds the copy checked."""
        self._check = _Check(self.folder, self.rank, self.runtime.world_size, self.verify)
        self._check.start()

    def wait_check(self) -> float:
        """Wait for ``start_check`` (bounded); the seconds it took (0: none started)."""
        if self._check is None:
            return 0.0
        self._check.join(self.timeout_s)
        return self._check.seconds

    def _drop_check(self) -> None:
        check, self._check = self._check, None
        if check is not None:
            check.join(self.timeout_s)
            if check.opened is not None:
                check.opened.close()

    def _opened(self, copy: Copy, check: str) -> Opened:
        """``copy`` opened and checked as ``check`` says: by ``start_check`` when it
        checked this copy."""
        early, self._check = self._check, None
        if early is not None:
            early.join(self.timeout_s)
            if not early.is_alive() and early.copy is not None \
                    and early.copy.path == copy.path and early.copy.step == copy.step:
                if early.error is not None:
                    raise early.error
                return early.opened
            if not early.is_alive() and early.opened is not None:
                early.opened.close()
        return Opened(copy, check)

    def slots(self, rank: int) -> list[Slot]:
        if rank not in self._slots:
            self._slots[rank] = slots_of(self.folder, rank)
        return self._slots[rank]

    def _next_slot(self, rank: int) -> Slot:
        """The slot to write next: not the one with the newest complete copy (known after
        a round from what it committed; at the start, from the commit records)."""
        slots = self.slots(rank)
        if rank in self._newest:
            return slots[1 - slots.index(self._newest[rank])]

        def age(slot: Slot) -> int:
            copy = slot.complete()
            return -1 if copy is None else copy.step
        return min(slots, key=age)

    def _committed(self, rank: int, copy: Copy | None) -> Copy | None:
        if copy is not None:
            self._newest[rank] = next(s for s in self.slots(rank) if s.path == copy.path)
        return copy

    # ------------------------------------------------------------- each step --
    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, state: dict[str, Any], record: dict[str, Any]) -> Round | None:
        """The memory save at ``step`` (every rank): one copy of the state into a slot,
        then the commit and the partner's copy in the tier's thread. Skipped on every
        rank, with a notice, while any rank's previous round is still under way."""
        (busy,) = any_rank(not self._idle.is_set())
        if busy:
            self.skipped += 1
            if self.skipped == 1:
                self.metrics.say(f"notice: memory copy of step {step} skipped: the previous "
                                 "one is still being committed or sent to the partner node")
            return None
        began = time.perf_counter()
        tree, tensors = flatten(state)
        slot = self._next_slot(self.rank)
        table = slot.stage(tensors)
        done = Round(step, time.perf_counter() - began, table_of_size(table))
        extra = {"world_size": self.runtime.world_size,
                 "device_type": self.runtime.device.type, "training": record}
        self._idle.clear()
        self._jobs.put((done, slot, table, tree, extra))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="memory-tier", daemon=True)
            self._worker.start()
        return done

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                self._round(*job)
            except Exception:   # a failed round costs that copy, not the thread
                log.exception("memory tier: the round of step %d failed", job[0].step)
            finally:
                self._idle.set()

    def _round(self, done: Round, slot: Slot, table: list, tree: dict[str, Any],
               extra: dict[str, Any]) -> None:
        own: Copy | None = None
        try:
            began = time.perf_counter()
            own = self._committed(self.rank, slot.commit(
                rank=self.rank, step=done.step, table=table, skeleton=encode(tree),
                extra=extra))
            done.commit_s = time.perf_counter() - began
        except Exception as exc:  # noqa: BLE001 - a failed copy costs only this copy
            done.error = f"commit: {exc}"
        if self.group is not None:
            began = time.perf_counter()
            try:
                self._exchange(own)
            except Exception as exc:  # noqa: BLE001 - a partner lost mid-round, damage
                done.error = f"{done.error + '; ' if done.error else ''}partner copy: {exc}"
            done.replicate_s = time.perf_counter() - began
        if done.error:
            log.warning("memory copy of step %d: %s", done.step, done.error)
        self.rounds.append(done)
        self.metrics.event(Event.memory_save, step=done.step, stall_s=done.stall_s,
                           commit_s=done.commit_s, replicate_s=done.replicate_s,
                           bytes=done.bytes, nodes=self.partners.nodes, error=done.error)

    def _exchange(self, own: Copy | None) -> None:
        """Send this rank's copy to its partner; receive the copies this rank holds."""
        receipts = [Receipt(source, self._next_slot(source), self.group)
                    for source in self.partners.sources(self.rank)]
        partner = self.partners.partner[self.rank]
        sending = Sending(own, partner, self.group) if partner is not None else None
        failures = []
        for receipt in receipts:
            try:
                self._committed(receipt.source, receipt.finish())
            except Exception as exc:  # noqa: BLE001 - the others still count
                failures.append(f"from rank {receipt.source}: {exc}")
        if sending is not None:
            sending.wait()
        if failures:
            raise MemoryCopyError("; ".join(failures))

    def wait(self, timeout_s: float | None = None) -> bool:
        """The round under way is over (bounded); False if it is not."""
        return self._idle.wait(self.timeout_s if timeout_s is None else timeout_s)

    # ---------------------------------------------------------------- restore --
    def newest_own_step(self) -> int | None:
        """The step of this rank's newest complete copy on this node (None: none)."""
        copy = newest_copy(self.folder, self.rank, self.runtime.world_size)
        return copy.step if copy is not None else None

    def restore(self, state: dict[str, Any], durable_step: int | None) -> Committed | None:
        """Load the newest copy every rank can reach when it is not older than
        ``durable_step``; the copy as a Committed (``tier`` "memory"), or None."""
        world = self.runtime.world_size
        found = {key: copy for key, copy in inventory(self.folder, world).items()
                 if copy.record.get("device_type") == self.runtime.device.type}
        holders: dict[tuple[int, int], list[int]] = {}
        for rank, keys in enumerate(_all_gather(sorted(found))):
            for key in keys:
                holders.setdefault(tuple(key), []).append(rank)
        steps = sorted({step for _, step in holders}, reverse=True)
        chosen = next((s for s in steps if all((r, s) in holders for r in range(world))
                       and (durable_step is None or s >= durable_step)), None)
        if chosen is None:
            self._drop_check()
            return None
        error = None
        mine = found.get((self.rank, chosen))
        check = self.verify   # a copy received below was checked as it arrived
        for rank in range(world):   # copies of a lost node's ranks, from their partners
            where = holders[(rank, chosen)]
            if rank in where:
                continue
            source = min(where)
            try:
                if self.rank == source:
                    Sending(found[(rank, chosen)], rank).wait()
                elif self.rank == rank:
                    mine = self._committed(rank, Receipt(source, self._next_slot(rank)).finish())
                    check = "none"
            except Exception as exc:  # noqa: BLE001 - every rank learns below
                error = f"receiving it from rank {source}: {exc}"
        fitted = None
        if error is None:
            try:
                if mine is None:
                    raise MemoryCopyError("no copy arrived")
                fitted = fit(state, self._opened(mine, check))
            except (OSError, MemoryCopyError) as exc:
                error = str(exc)
        (failed,) = any_rank(error is not None)
        phases.mark(Phase.checkpoint_chosen)
        if failed:
            if fitted is not None:
                fitted.opened.close()
            self.metrics.say(f"warning: the memory copy of step {chosen} cannot be used "
                             f"({error or 'on another rank'}); loading from durable storage")
            return None
        try:
            apply(state, fitted)
        finally:
            fitted.opened.close()
        phases.mark(Phase.loaded)
        received = sum(1 for r in range(world) if r not in holders[(r, chosen)])
        where = "this node" if received == 0 else f"partner nodes ({received} rank(s))"
        return Committed(step=chosen, name=f"memory copy of step {chosen}",
                         path=f"{self.folder} (memory copy of step {chosen}, from {where})",
                         record=dict(mine.record["training"]), tier="memory")

    # -------------------------------------------------------------------- end --
    def close(self, *, free_copies: bool) -> None:
        """Wait for the round under way (bounded) and, when the job's final state is
        durable, free this node's copies (every rank, then the folder)."""
        self.wait()
        self._drop_check()
        for slots in self._slots.values():
            for slot in slots:
                slot.close()
        if free_copies:
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
            if self.runtime.local_rank == 0:
                free(self.folder)

    def held_bytes(self) -> int:
        """The bytes of copies this rank's slots hold on this node (its own, its sources')."""
        total = 0
        for slots in self._slots.values():
            for slot in slots:
                for name in (DATA, SKELETON):
                    try:
                        total += (slot.path / name).stat().st_size
                    except OSError:
                        pass
        return total


class _Check(threading.Thread):
    """Open and check a rank's newest complete copy on this node (``start_check``)."""

    def __init__(self, folder: Path, rank: int, world_size: int, verify: str) -> None:
        super().__init__(name="memory-tier-check", daemon=True)
        self.folder, self.rank, self.world_size, self.verify = folder, rank, world_size, verify
        self.copy: Copy | None = None
        self.opened: Opened | None = None
        self.error: Exception | None = None
        self.seconds = 0.0

    def run(self) -> None:
        began = time.perf_counter()
        self.copy = newest_copy(self.folder, self.rank, self.world_size)
        if self.copy is not None:
            try:
                self.opened = Opened(self.copy, self.verify)
            except (OSError, MemoryCopyError) as exc:
                self.error = exc
        self.seconds = time.perf_counter() - began


def _all_gather(value: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
