"""Helpers for the template's tests: render the template, run what it generated."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from copier import run_copy

REPO = Path(__file__).resolve().parents[1]


def render(dst: Path, **answers) -> Path:
    """Render the working tree of the template into ``dst`` non-interactively.

    ``vcs_ref="HEAD"``: without it copier renders the newest release tag (v0.1.0 on), not
    the working tree.
    """
    run_copy(str(REPO), str(dst), data=answers, defaults=True, quiet=True, unsafe=False,
             vcs_ref="HEAD")
    return dst


def git(cwd: Path, *args: str) -> str:
    """``git args`` in ``cwd`` with a throwaway identity and branch name; its stdout."""
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           "-c", "init.defaultBranch=main", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(log_dir: Path, kind: str) -> list[dict]:
    """The events of one kind in ``log_dir``/metrics.jsonl (none before it exists)."""
    path = log_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def assert_merged(project: Path) -> None:
    """After a ``copier update``: no file of the project holds a conflict marker, and
    no ``.rej`` file (a hunk copier could not apply) was left. Not read: git's files,
    the bytecode Python caches (a ``.pyc`` holds the docstrings that name the markers)
    and checkpoints a test wrote."""
    skip = {".git", "__pycache__", "checkpoints"}
    for path in (p for p in project.rglob("*") if p.is_file() and not skip & set(p.parts)):
        text = path.read_text(errors="replace")
        assert "<<<<<<<" not in text and ">>>>>>>" not in text, path
        assert not path.name.endswith(".rej"), path


def package_of(project: Path) -> str:
    return next(p.parent.name for p in (project / "src").glob("*/train.py"))


def run_in(project: Path, *args: str, timeout: float = 900,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python args`` inside a generated project, its src/ on the path."""
    env = dict(os.environ, PYTHONPATH=str(project / "src"), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\n{proc.stdout[-5000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("default") / "my-run")


# Every optional part on (copier.yml, "optional parts"): its whole suite runs in make test.
FULL = {"memory_tier": True, "trackers": True, "straggler_detection": True,
        "multi_node_drill": True, "cloud": "aws"}


@pytest.fixture(scope="session")
def full_project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("full") / "my-run", **FULL)


# The longest tests first, so that with `pytest -n 2 --dist worksteal` (each worker
# starts from its half of the list) each worker starts one at once: make test's two
# halves of the full render's suite, the first at the head of the list and the second
# at its middle, the upgrade test (the next longest) after the first; make check's
# longest, the default render's fast tier (itself two processes), at the head. The other
# slow tests (real Slurm, the DDP and unusual renders: 30 to 110 s each) come next, a
# file's together (its module fixtures, a Slurm cluster, are made once), each file to the
# worker with fewer so far; the quick ones last: an idle worker steals from the end of
# the other's list, so the suite ends on quick tests, not on one long test alone.
HEAD_OF_FIRST = ("test_full_project_own_test_suite_passes[first]",
                 "test_default_project_fast_tier_passes",
                 "test_a_v0_1_0_project_updates_passes_its_own_suite_and_resumes_its_checkpoint")
HEAD_OF_SECOND = ("test_full_project_own_test_suite_passes[second]",)


def pytest_collection_modifyitems(config, items):
    longest = {item.name: item for item in items if item.name in HEAD_OF_FIRST + HEAD_OF_SECOND}
    rest = [item for item in items if item.name not in longest]
    quick = [item for item in rest if "slow" not in item.keywords]
    first = [longest[n] for n in HEAD_OF_FIRST if n in longest]
    second = [longest[n] for n in HEAD_OF_SECOND if n in longest]
    files: dict[Path, list] = {}
    for item in rest:
        if "slow" in item.keywords:
            files.setdefault(item.path, []).append(item)
    for tests in files.values():
        (second if len(second) <= len(first) else first).extend(tests)
    middle = max(0, (len(items) + 1) // 2 - len(first))
    items[:] = first + quick[:middle] + second + quick[middle:]
