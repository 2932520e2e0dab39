"""Check checkpoints against the checksums their commit.json recorded.

    python -m <package>.verify                              every checkpoint in checkpoint.dir
    python -m <package>.verify checkpoints/step_000001200   one checkpoint
    python -m <package>.verify /mnt/old-run/checkpoints     every checkpoint in a directory
    python -m <package>.verify s3://bucket/run [--config PATH] [key=value ...]

Each checkpoint is checked as a load would check it, and more (commit.json, sizes, CRC-32
checksums as ``checkpoint.verify`` says, a ``.metadata`` the restricted loader accepts), a
table row each: docs/RESUMING.md, "Damaged bytes: checksums". Exit status: 0 nothing
failed (or no checkpoint), 1 a checkpoint FAILED, 2 bad input (configuration, a missing
path or not a checkpoint, refused credentials), 73 the storage was unreachable for
``checkpoint.storage_retry_s`` (nothing judged: run again).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from .. import PACKAGE
from ..checkpoint.store import layout
from ..checkpoint.store.errors import human_bytes
from ..checkpoint.store.outage import ends_storage_errors, with_retries
from ..checkpoint.store.storage import open_storage
from ..config import OBJECT_STORE_SCHEMES, ConfigError, VerifyMode, load_config
from ..runtime import exit_codes
from ..runtime.exit_codes import Refused, refusals

_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.verify",
        description="Check checkpoints against the checksums recorded when they were committed.",
        epilog="Without CHECKPOINT|DIR, every checkpoint under checkpoint.dir is checked. "
               "checkpoint.verify=sample reads a part of each large file; otherwise all of it.")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("items", nargs="*", metavar="CHECKPOINT|DIR or key=value")
    return parser.parse_args(argv)


def _target(items: list[str]) -> tuple[str | None, list[str]]:
    paths = [item for item in items if not _OVERRIDE.match(item)]
    if len(paths) > 1:
        raise ConfigError(f"give one checkpoint or directory, not {len(paths)}: {paths}")
    return (paths[0] if paths else None), [item for item in items if _OVERRIDE.match(item)]


def _split(target: str) -> tuple[str, str | None]:
    """(root, checkpoint name or None) for a checkpoint or a directory of checkpoints."""
    stripped = target.rstrip("/")
    parent, _, last = stripped.rpartition("/")
    if re.fullmatch(r"step_\d{9}", last):
        return (parent or "."), last
    return stripped or "/", None


@refusals
@ends_storage_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target, overrides = _target(args.items)
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        raise Refused(exc) from exc
    mode = "sample" if cfg.checkpoint.verify == VerifyMode.sample else "all"
    root, single = _split(target if target is not None else cfg.checkpoint.dir)
    is_url = root.startswith(tuple(f"{s}://" for s in OBJECT_STORE_SCHEMES))
    if not is_url and not Path(root.removeprefix("file://")).is_dir():
        what = "does not exist" if not Path(root).exists() else "is not a directory"
        raise Refused(f"{target or f'checkpoint.dir={root}'} {what}")
    try:
        storage = open_storage(root)
        names = with_retries(lambda: layout.checkpoint_names(storage), root,
                             cfg.checkpoint.storage_retry_s)
    except RuntimeError as exc:   # an object-store URL whose driver is not installed
        raise Refused(f"cannot read {root}: {exc}") from exc
    if single is not None:
        if single not in names:
            raise Refused(f"{storage.path(single)} does not exist")
        names = [single]
    if not names:
        print(f"no checkpoints in {storage}")
        return exit_codes.OK

    print(f"verifying {len(names)} checkpoint(s) in {storage} (checksums: {mode})")
    row = "{:>10}  {:>5}  {:>12}  {:<11}  {}"
    print(row.format("step", "files", "bytes", "status", "reason"))
    began, checked, verdicts = time.perf_counter(), 0, []
    for name in reversed(names):  # newest first, as a resume looks at them
        verdict = layout.verify_checkpoint(storage, name, mode)
        verdicts.append(verdict)
        checked += verdict.checked_bytes
        print(row.format(verdict.step, verdict.files, f"{verdict.bytes:,}", verdict.status,
                         verdict.reason).rstrip(), flush=True)
    seconds = time.perf_counter() - began
    counts = {status: sum(v.status == status for v in verdicts)
              for status in ("ok", "unverified", "uncommitted", "FAILED")}
    rate = f", {checked / seconds / 1e6:,.0f} MB/s" if checked and seconds > 0 else ""
    print(f"checked {len(verdicts)}: "
          + ", ".join(f"{n} {status}" for status, n in counts.items() if n or status == "FAILED")
          + f"; checksummed {human_bytes(checked)} in {seconds:.1f} s{rate}")
    ckpt = cfg.checkpoint
    if ckpt.keep_best > 0 and single is None:
        rule = layout.BestRule(ckpt.keep_best, ckpt.best_metric, ckpt.best_mode)
        best = rule.best(layout.list_committed(storage, warn=False))
        kept = ", ".join(f"step {c.step} ({ckpt.best_metric} {rule.score(c):.6g})" for c in best)
        print(f"kept as best (checkpoint.keep_best={ckpt.keep_best}, {ckpt.best_metric}, "
              f"{ckpt.best_mode}): {kept or 'none evaluated at its own step yet'}")
    return exit_codes.FAILED if any(v.failed for v in verdicts) else exit_codes.OK
