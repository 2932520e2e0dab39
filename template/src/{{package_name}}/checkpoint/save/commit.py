"""A save's records (what is in flight, what committed) and its commit: commit.json with
the checksums the writers recorded, then the retirement of old checkpoints
(docs/RESUMING.md: what commit.json holds)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from ...config import AsyncMode
from ..store import layout
from ..store.lease import Lease
from ..store.storage import Storage

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    """What the training loop and metrics learn about a committed save."""

    step: int
    reason: str
    mode: str
    blocking_s: float
    commit_latency_s: float
    path: str
    removed: list[str] = field(default_factory=list)
    # Seconds from handing the state to DCP until every shard and .metadata were written:
    # what a blocking save at preemption is expected to need.
    write_s: float = 0.0


@dataclass
class InFlight:
    step: int
    reason: str
    record: dict[str, Any]
    started: float
    blocking_s: float
    upload: Future
    staging: Future | None
    handed_off: float = 0.0           # perf_counter() when DCP got the state
    written: float | None = None      # perf_counter() when the upload finished
    committed: Future | None = None   # the coordinator's commit, run once the upload is done
    metadata: Any = None              # DCP's Metadata of the written save (names every file)
    given_up: bool = False            # abandoned: the commit must not happen any more


class NotCommitted(RuntimeError):
    """A written save could not be committed; the message says what happened to it."""


def commit_written(inflight: InFlight, storage: Storage, mode: AsyncMode, lease: Lease | None,
                   keep_last: int, best: layout.BestRule) -> SaveResult:
    """Write commit.json (with the writers' checksums) and retire old checkpoints (the
    coordinator, once every shard is written); raises NotCommitted."""
    latency = time.perf_counter() - inflight.started
    write_s = (inflight.written or time.perf_counter()) - inflight.handed_off
    record = {
        **inflight.record,
        "reason": inflight.reason,
        "mode": mode.value,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "blocking_s": round(inflight.blocking_s, 6),
        "commit_latency_s": round(latency, 6),
        "write_s": round(write_s, 6),
        "torch_version": torch.__version__,
    }
    if lease is not None and not lease.held:
        raise NotCommitted("was written but not committed: another job has taken over "
                           "the checkpoint directory (see the log)")
    try:
        committed = layout.commit(storage, inflight.step, record, metadata=inflight.metadata)
    except (OSError, RuntimeError) as exc:
        raise NotCommitted("was written but not committed") from exc
    # The latency ends at the commit (the checkpoint counts from here), not the retirement.
    latency = time.perf_counter() - inflight.started
    try:
        removed = layout.retire_old(storage, keep_last, up_to=inflight.step, best=best)
    except OSError as exc:  # the new checkpoint is safe; old ones just linger
        log.warning("could not remove old checkpoints: %s", exc)
        removed = []
    return SaveResult(inflight.step, inflight.reason, mode.value, inflight.blocking_s, latency,
                      committed.path, removed, write_s)
