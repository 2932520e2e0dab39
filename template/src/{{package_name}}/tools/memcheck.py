"""Memory check: resident memory of a training run does not grow with the token data's size.

    python -m <package>.memcheck [--sizes 200MB 2GB] [--steps 40] [--dir DIR] [key=value ...]

For each size: random tokens in prepare_data's format (deleted afterwards), one training
process on them (synchronous saves, configs/train.yaml's model unless key=value says
otherwise), its ``VmRSS`` (/proc, Linux) sampled every 20 ms; prints each run's peak and
the largest relative difference. Exit status: 0 within 10 %, 1 otherwise, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import PACKAGE
from ..config import ConfigError, load_config
from ..datasets.tokens import FORMAT, INDEX_FILE, VERSION
from ..launch.torchrun import positive_int
from ..runtime import exit_codes
from ..runtime.exit_codes import Refused, refusals
from ..runtime.output_dirs import ignore_in_git, make_output_dir
from .export import parse_size

TOLERANCE = 0.10
CHUNK = 1 << 25  # tokens written at a time


def write_tokens(directory: Path, size_bytes: int, seed: int = 0) -> int:
    """A token directory of ``size_bytes`` bytes of random uint16 tokens (bytes vocabulary)."""
    directory.mkdir(parents=True)
    total = size_bytes // 2
    rng = np.random.default_rng(seed)
    with open(directory / "tokens_00000.bin", "wb") as handle:
        for start in range(0, total, CHUNK):
            rng.integers(0, 257, min(CHUNK, total - start), dtype=np.uint16).tofile(handle)
    index = {"format": FORMAT, "version": VERSION, "dtype": "uint16", "vocab_size": 257,
             "separator": 256, "tokenizer": "bytes", "tokens": total, "documents": 0,
             "inputs": [], "files": [{"name": "tokens_00000.bin", "tokens": total,
                                      "documents": 0}]}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return total


def _status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of ``pid`` in KiB (empty once it has exited)."""
    fields = {}
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                fields[name] = int(value.split()[0])
    return fields


def measure(data: Path, work: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    """Peak resident memory (MiB) of one training process on ``data``."""
    command = [sys.executable, "-m", f"{PACKAGE}.train", "data.kind=tokens",
               f"data.path={data}", f"train.max_steps={steps}", "checkpoint.async_mode=sync",
               f"checkpoint.interval_steps={steps}", f"checkpoint.dir={work / 'ckpt'}",
               f"log.dir={work / 'logs'}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    peak: dict[str, int] = {}
    with open(work / "train.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            peak = max(peak, _status(proc.pid), key=lambda fields: fields.get("VmRSS", 0))
            time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"training exited {proc.returncode}; see {work / 'train.log'}")
    return {name: value / 1024 for name, value in peak.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.memcheck",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=None, metavar="SIZE",
                        help="token data sizes (default 200MB 2GB)")
    parser.add_argument("--steps", type=positive_int, default=40, help="training steps per run")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the token data is written (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


@refusals
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = args.sizes or [parse_size("200MB"), parse_size("2GB")]
    if not Path("/proc/self/status").exists():
        raise Refused("memcheck reads /proc (Linux only)")
    try:  # configs/train.yaml and the overrides, before any token data is written
        load_config(None, args.overrides)
    except ConfigError as exc:
        raise Refused(exc) from exc
    root = Path(tempfile.mkdtemp(prefix="memcheck-",
                                 dir=make_output_dir(args.dir) if args.dir else None))
    ignore_in_git(root)   # removed at the end; meanwhile (or after a kill) never in git
    rss = []
    try:
        for size in sizes:
            base = root / f"{size}"
            base.mkdir()
            began = time.monotonic()
            tokens = write_tokens(base / "tokens", size)
            written = time.monotonic() - began
            peak = measure(base / "tokens", base, args.steps, args.overrides)
            rss.append(peak["VmRSS"])
            print(f"{size / 2**20:9,.0f} MiB of tokens ({tokens:,} tokens, written in "
                  f"{written:.1f} s): peak resident {peak['VmRSS']:7.1f} MiB "
                  f"(anonymous {peak.get('RssAnon', 0):.1f}, file-backed "
                  f"{peak.get('RssFile', 0):.1f})", flush=True)
            shutil.rmtree(base / "tokens")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    spread = (max(rss) - min(rss)) / min(rss)
    verdict = "within" if spread < TOLERANCE else "NOT within"
    print(f"largest difference {spread * 100:.1f}%: {verdict} {TOLERANCE * 100:.0f}%")
    return exit_codes.OK if spread < TOLERANCE else exit_codes.FAILED
