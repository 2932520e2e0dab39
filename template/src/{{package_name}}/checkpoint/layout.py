"""The commit protocol: how a checkpoint is named, committed, found again and retired.

    <root>/step_000000120/          a committed checkpoint
        .metadata                   DCP's global tensor layout (written by the coordinator)
        __0_0.distcp, __1_0.distcp  one shard file per rank
        commit.json                 written last; lists every file with its size
    <root>/step_000000130.tmp/      a save in progress (local filesystems only)
    <root>/step_000000100.deleting/ an old checkpoint being removed

A checkpoint counts only when ``commit.json`` exists, parses, and every file it lists
is present with the recorded size. On a filesystem with atomic rename the directory is
also written under ``.tmp`` and renamed after the commit file, so a ``step_*``
directory is complete or absent; on object stores the commit file alone decides.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from .storage import Storage

log = logging.getLogger(__name__)

COMMIT_FILE = "commit.json"
METADATA_FILE = ".metadata"
FORMAT_VERSION = 1
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

    @property
    def world_size(self) -> int:
        return int(self.record["world_size"])


def make_room(storage: Storage, step: int) -> None:
    """Clear the place a save of ``step`` is about to write to (coordinator, before the save).

    An unfinished earlier attempt must not mix with the new shards; on object stores an
    earlier committed copy must go too, or its old commit.json would vouch for a
    half-written new one. Other ranks write only after the coordinator has taken part
    in planning, so nothing of the new save exists yet.
    """
    work = staging_name(step, storage)
    if work in storage.list_names():
        if storage.atomic_rename:
            storage.remove_tree(work)   # a .tmp directory: never a checkpoint
        else:
            _discard(storage, work)     # commit.json first, then the shards
    storage.makedirs(work)


def commit(storage: Storage, step: int, record: dict[str, Any]) -> Committed:
    """Seal a finished save: write commit.json last, then move it into place.

    Call only after every rank's shards and the metadata file are written. Every file
    that DCP's metadata names must be visible here: a checkpoint directory that is not
    shared by all ranks (node-local disks) is refused rather than committed incomplete.
    """
    work = staging_name(step, storage)
    files = storage.list_files(work)
    if METADATA_FILE not in files:
        raise RuntimeError(f"cannot commit {work}: {METADATA_FILE} is missing")
    named = {info.relative_path for info in
             storage.reader(work).read_metadata().storage_data.values()}
    missing = sorted(named - files.keys())
    if missing:
        raise RuntimeError(
            f"cannot commit {storage.path(work)}: {', '.join(missing)} not visible to rank 0; "
            "checkpoint.dir must be storage that all ranks share")
    files.pop(COMMIT_FILE, None)
    record = {**record, "step": step, "format_version": FORMAT_VERSION, "files": files}
    storage.write_text_durable(f"{work}/{COMMIT_FILE}", json.dumps(record, indent=1) + "\n")
    final = step_name(step)
    if work != final:
        if final in storage.list_names():
            # A checkpoint of this step exists already (e.g. written by an earlier run
            # that crashed after committing): retire it before taking its name.
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
    files = record.get("files")
    if not isinstance(files, dict) or METADATA_FILE not in files:
        return None, f"{COMMIT_FILE} lists no {METADATA_FILE}"
    for file_name, size in files.items():
        actual = storage.size(f"{name}/{file_name}")
        if actual != size:
            what = "missing" if actual is None else f"{actual} bytes, expected {size}"
            return None, f"{file_name} is {what}"
    return record, ""


def _complete_newest_first(storage: Storage, *, warn: bool):
    """Complete checkpoints, newest first; damaged ones are skipped with a warning."""
    names = sorted((n for n in storage.list_names() if _NAME.match(n)), reverse=True)
    for name in names:
        step = int(_NAME.match(name).group(1))
        record, problem = _verify(storage, name, step)
        if record is None:
            if warn:
                log.warning("skipping checkpoint %s: %s", storage.path(name), problem)
            continue
        yield Committed(step, name, storage.path(name), record)


def list_committed(storage: Storage, *, warn: bool = True) -> list[Committed]:
    """Every complete checkpoint, oldest first."""
    return list(_complete_newest_first(storage, warn=warn))[::-1]


def newest_complete_checkpoint(storage: Storage) -> Committed | None:
    """The checkpoint to resume from; older ones are not even read."""
    return next(_complete_newest_first(storage, warn=True), None)


def retire_old(storage: Storage, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` committed checkpoints; returns their names.

    A half-deleted checkpoint never looks complete (see ``_discard``).
    """
    removed = []
    for old in list_committed(storage, warn=False)[:-keep_last]:
        _discard(storage, old.name)
        removed.append(old.name)
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
    """Remove saves that never committed and removals that never finished.

    On object stores an unfinished save is a ``step_*`` prefix without a commit file.
    """
    leftovers = []
    for name in storage.list_names():
        unfinished = (not storage.atomic_rename and _NAME.match(name)
                      and storage.size(f"{name}/{COMMIT_FILE}") is None)
        if _LEFTOVER.match(name) or unfinished:
            storage.remove_tree(name)
            leftovers.append(name)
    return leftovers
