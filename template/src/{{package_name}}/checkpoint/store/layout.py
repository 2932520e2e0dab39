"""The layout of checkpoint.dir: how a checkpoint is named, committed, found again and retired.

    <root>/step_000000120/          a committed checkpoint
        .metadata                   DCP's global tensor layout (written by the coordinator)
        __0_0.distcp, __1_0.distcp  one shard file per rank
        commit.json                 written last; lists every file with its size and checksum
    <root>/step_000000130.tmp/      a save in progress (local filesystems only)
    <root>/step_000000100.deleting/ an old checkpoint being removed

A checkpoint counts only when ``commit.json`` lists every file present with its size (its
checksums are checked as it loads). With atomic rename a ``step_*`` directory is whole or
absent; on object stores the commit file alone decides (docs/RESUMING.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...runtime.distributed import decide_on_rank0
from . import integrity
from .errors import StorageError, StorageUnavailable, human_bytes, is_transient
from .outage import with_retries
from .storage import Storage, check_space, probe

if TYPE_CHECKING:   # resume lists checkpoints without importing DCP
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)

COMMIT_FILE = "commit.json"
METADATA_FILE = ".metadata"
FORMAT_VERSION = 2  # 2: "files" maps each name to {"size", "crc32"} (1: to its size)
_NAME = re.compile(r"^step_(\d{9})$")
_LEFTOVER = re.compile(r"^step_\d{9}\.(tmp|deleting)$")


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def staging_name(step: int, storage: Storage) -> str:
    """Where the shards of a save in progress are written."""
    return step_name(step) + ".tmp" if storage.atomic_rename else step_name(step)


@dataclass(frozen=True)
class Committed:
    """A complete checkpoint found on storage."""

    step: int
    name: str
    path: str
    record: dict[str, Any]
    tier: str = "durable"   # or "memory": a copy of the memory tier (memory_tier.py)

    @property
    def world_size(self) -> int:
        return int(self.record["world_size"])


def make_room(storage: Storage, step: int) -> None:
    """Clear where a save of ``step`` will write (coordinator, before the save): an earlier
    unfinished attempt must not mix with the new shards, and on object stores an earlier
    committed copy must go too, or its commit.json would vouch for a half-written new one.
    Other ranks write only after the coordinator has planned: nothing new exists yet."""
    work = staging_name(step, storage)
    if work in storage.list_names():
        if storage.atomic_rename:
            storage.remove_tree(work)   # a .tmp directory: never a checkpoint
        else:
            _discard(storage, work)     # commit.json first, then the shards
    storage.makedirs(work)


def commit(storage: Storage, step: int, record: dict[str, Any],
           metadata: Metadata | None = None) -> Committed:
    """Seal a fully written save: commit.json last, then into place. A file not visible here
    (storage not shared by all ranks) is refused, not committed incomplete; ``metadata``
    (what DCP's save returned) is checked too when given. No file is read back."""
    work = staging_name(step, storage)
    files = storage.list_files(work)
    if METADATA_FILE not in files:
        raise RuntimeError(f"cannot commit {work}: {METADATA_FILE} is missing")
    written = getattr(metadata, "storage_data", None)
    named = {i.relative_path for i in written.values()} if isinstance(written, dict) else set()
    if missing := sorted(named - files.keys()):
        raise RuntimeError(
            f"cannot commit {storage.path(work)}: {', '.join(missing)} not visible to rank 0; "
            "checkpoint.dir must be storage that all ranks share")
    files.pop(COMMIT_FILE, None)
    entries, block = integrity.recorded_entries(storage, work, files)
    storage.remove_file(f"{work}/{integrity.RECORD_FILE}")   # all in commit.json now
    checksum = {"algorithm": integrity.ALGORITHM, "block_bytes": block}
    record = {**record, "step": step, "format_version": FORMAT_VERSION, "files": entries,
              "checksum": checksum}
    storage.write_text_durable(f"{work}/{COMMIT_FILE}", json.dumps(record, indent=1) + "\n")
    final = step_name(step)
    if work != final:
        if final in storage.list_names():
            # One of this step exists (an earlier run crashed after committing): retire it.
            _discard(storage, final)
        storage.rename(work, final)
    return Committed(step, final, storage.path(final), record)


def _verify(storage: Storage, name: str, step: int) -> tuple[dict[str, Any] | None, str]:
    try:
        record = json.loads(storage.read_text(f"{name}/{COMMIT_FILE}"))
    except FileNotFoundError:
        return None, f"no {COMMIT_FILE} (the save never committed)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable {COMMIT_FILE}: {exc}"
    if not isinstance(record, dict) or record.get("step") != step:
        return None, f"{COMMIT_FILE} does not describe step {step}"
    if not isinstance(record.get("world_size"), int) or record["world_size"] < 1:
        return None, f"{COMMIT_FILE} has no valid world_size"
    if (files := integrity.file_sizes(record)) is None:
        return None, f"{COMMIT_FILE} has no valid list of files"
    if METADATA_FILE not in files:
        return None, f"{COMMIT_FILE} lists no {METADATA_FILE}"
    for file_name, size in files.items():
        actual = storage.size(f"{name}/{file_name}")
        if actual != size:
            what = "missing" if actual is None else f"{actual} bytes, expected {size}"
            return None, f"{file_name} is {what}"
    return record, ""


def _complete_newest_first(storage: Storage, *, warn: bool):
    """Complete checkpoints, newest first; damaged ones are skipped with a warning."""
    for name in reversed(checkpoint_names(storage)):
        step = int(_NAME.match(name).group(1))
        record, problem = _verify(storage, name, step)
        if record is not None:
            yield Committed(step, name, storage.path(name), record)
        elif warn:
            log.warning("skipping checkpoint %s: %s", storage.path(name), problem)


def list_committed(storage: Storage, *, warn: bool = True) -> list[Committed]:
    """Every complete checkpoint, oldest first."""
    return list(_complete_newest_first(storage, warn=warn))[::-1]


def newest_complete_checkpoint(storage: Storage, *, verify: str = "all") -> Committed | None:
    """The newest complete checkpoint whose files match their checksums (``verify``:
    checkpoint.verify); one that fails is skipped with a warning, older ones are not read."""
    for checkpoint in sized_newest_first(storage):
        check = integrity.check_contents(storage, checkpoint.name, checkpoint.record, verify)
        if not check.problem:
            return checkpoint
        log.warning("skipping checkpoint %s: %s", checkpoint.path, check.problem)
    return None


def sized_newest_first(storage: Storage):
    """Complete checkpoints (commit record, every file of its size), newest first, contents
    unread: for a load that checks the checksums as it reads (``reader.py``)."""
    for checkpoint in _complete_newest_first(storage, warn=True):
        if integrity.expected(checkpoint.record) is None:
            log.warning("note: checkpoint %s has no checksums in its %s (an older version "
                        "committed it): its file sizes are checked, its contents are not",
                        checkpoint.path, COMMIT_FILE)
        yield checkpoint


@dataclass(frozen=True)
class Verdict:
    """One checkpoint checked in full (``python -m <package>.verify``)."""

    name: str
    step: int
    files: int
    bytes: int
    checked_bytes: int
    status: str          # ok | unverified (no checksums recorded) | uncommitted | FAILED
    reason: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAILED"


def verify_checkpoint(storage: Storage, name: str, verify: str = "all") -> Verdict:
    """Check one ``step_*`` checkpoint: commit file, sizes, checksums, a loadable .metadata.
    No commit.json is "uncommitted", not a failure; whatever discovery would skip is."""
    match = _NAME.match(name)
    if not match:
        raise ValueError(f"{storage.path(name)} is not a checkpoint (step_<9 digits>)")
    step = int(match.group(1))
    record, problem = _verify(storage, name, step)
    if record is None:
        status = "uncommitted" if problem.startswith(f"no {COMMIT_FILE}") else "FAILED"
        return Verdict(name, step, 0, 0, 0, status, problem)
    check = integrity.check_contents(storage, name, record, verify)
    verdict = Verdict(name, step, check.files, check.bytes, check.checked_bytes,
                      "unverified" if check.unverified else "ok",
                      f"{COMMIT_FILE} has no checksums (an older version committed it)"
                      if check.unverified else "")
    if check.problem:
        return dataclasses.replace(verdict, status="FAILED", reason=check.problem)
    from . import metadata as metadata_file  # DCP's classes: only this check needs them

    try:
        with storage.open_read(f"{name}/{METADATA_FILE}") as handle:
            metadata_file.load_metadata(handle, storage.path(f"{name}/{METADATA_FILE}"))
    except (metadata_file.UnsafeCheckpointError, OSError) as exc:
        return dataclasses.replace(verdict, status="FAILED", reason=str(exc))
    return verdict


def checkpoint_names(storage: Storage) -> list[str]:
    """Every ``step_*`` name under the root, committed or not, oldest first."""
    return sorted(n for n in storage.list_names() if _NAME.match(n))


def space_needed(storage: Storage, keep_last: int) -> tuple[int | None, str]:
    """(Bytes the next saves still need, how that was computed), or (None, why) with no
    checkpoint to measure: ``keep_last + 1`` of the newest's size, less what is held."""
    if not (committed := list_committed(storage, warn=False)):
        return None, "no checkpoint to measure yet"
    sizes = [sum((integrity.file_sizes(c.record) or {}).values()) for c in committed]
    one, held = sizes[-1], sum(sizes[-keep_last:])
    return max(one, one * (keep_last + 1) - held), (
        f"checkpoint.keep_last={keep_last} + 1 checkpoints of {human_bytes(one)} each, "
        f"less {human_bytes(held)} held already")


def check_storage(storage: Storage, keep_last: int, retry_s: float = 0.0) -> None:
    """The start-up storage check (``probe``, ``space_needed``) on rank 0, its StorageError
    raised on every rank; before the model is built, so failing costs seconds."""
    def check() -> None:
        probe(storage)  # first: listing a root that is a file or lacks credentials fails
        check_space(storage, *space_needed(storage, keep_last))

    def verdict() -> tuple[str, bool] | None:
        try:
            with_retries(check, f"checkpoint.dir={storage}", retry_s)
        except StorageError as exc:
            return str(exc), isinstance(exc, StorageUnavailable)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for a verdict
            message = f"checkpoint.dir={storage} could not be checked: {type(exc).__name__}: {exc}"
            return message, is_transient(exc)
        return None

    if (refused := decide_on_rank0(verdict)) is not None:
        message, unreachable = refused
        raise (StorageUnavailable if unreachable else StorageError)(message)


@dataclass(frozen=True)
class BestRule:
    """Which checkpoints are kept as the best (checkpoint.keep_best, best_metric,
    best_mode): those whose own step was evaluated, ranked by that evaluation."""

    keep: int = 0
    metric: str = "eval_loss"
    mode: str = "min"

    def score(self, checkpoint: Committed) -> float | None:
        """The checkpoint's value of the metric, or None (not evaluated at its step)."""
        record = checkpoint.record
        value = (record.get("eval") or {}).get(self.metric)
        if record.get("last_eval_step") != checkpoint.step or not isinstance(value, (int, float)):
            return None
        return float(value) if math.isfinite(value) else None

    def best(self, committed: list[Committed]) -> list[Committed]:
        """The best ``keep`` of ``committed``, best first (ties: the newer first)."""
        if self.keep <= 0:
            return []
        scored = [(score, c) for c in committed if (score := self.score(c)) is not None]
        scored.sort(key=lambda sc: (sc[0] if self.mode == "min" else -sc[0], -sc[1].step))
        return [c for _, c in scored[:self.keep]]


def retire_old(storage: Storage, keep_last: int, *, up_to: int | None = None,
               best: BestRule | None = None) -> list[str]:
    """Remove all but the newest ``keep_last`` committed checkpoints and the best
    ``best.keep``; returns the names removed. With ``up_to`` (the step just committed),
    later steps neither count nor go: a run this one did not resume from (damaged, refused)
    left them, and counting them would retire this run's saves until it passes their step."""
    committed = [c for c in list_committed(storage, warn=False)
                 if up_to is None or c.step <= up_to]
    kept = {c.name for c in (best or BestRule()).best(committed)}
    removed = [old.name for old in committed[:-keep_last] if old.name not in kept]
    for name in removed:
        _discard(storage, name)
    return removed


def _discard(storage: Storage, name: str) -> None:
    if storage.atomic_rename:
        storage.rename(name, name + ".deleting")
        storage.remove_tree(name + ".deleting")
    else:
        # Without rename, the commit file goes first: the rest no longer counts.
        storage.remove_file(f"{name}/{COMMIT_FILE}")
        storage.remove_tree(name)


def clean_leftovers(storage: Storage) -> list[str]:
    """Remove saves that never committed (object stores: no commit.json) and unfinished removals."""
    leftovers = [name for name in storage.list_names() if _LEFTOVER.match(name) or (
        not storage.atomic_rename and _NAME.match(name)
        and storage.size(f"{name}/{COMMIT_FILE}") is None)]
    for name in leftovers:
        storage.remove_tree(name)
    return leftovers
