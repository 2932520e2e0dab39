"""Shared helpers: find the package, run its commands in subprocesses (torchrun too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = next(p.parent.name for p in sorted((ROOT / "src").glob("*/train.py")))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_module(module: str, *args: str, cwd: Path = ROOT, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python -m <package>.<module> args`` in a subprocess."""
    proc = subprocess.run([sys.executable, "-m", f"{PACKAGE}.{module}", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def torchrun(nproc: int, module: str, *args: str, cwd: Path = ROOT, timeout: float = 300,
             check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m <package>.<module> args`` on CPU (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", "-m", f"{PACKAGE}.{module}", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_metrics(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def run_dirs(tmp_path: Path) -> dict[str, str]:
    """Checkpoint and log directories of a throwaway run, as key=value overrides."""
    return {"ckpt": str(tmp_path / "ckpt"), "logs": str(tmp_path / "logs")}


@pytest.fixture(scope="session")
def package():
    sys.path.insert(0, str(ROOT / "src"))
    return __import__(PACKAGE)
