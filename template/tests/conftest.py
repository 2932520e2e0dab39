"""Shared helpers: find the package, run its commands in subprocesses (torchrun too).

Tests import the package's modules one way: ``project_module("name")``.

The harness's tests run on a task of their own, never on the project's task.py (the
user's: any shape, any age, untouched by ``copier update``). ``ROOT`` is a copy of the
project made once per test process (``suite_root``): its ``src/<package>/`` links every
file and folder of the project's package except ``task.py``, which is tests/suite_task.py
(the default task of this harness version); its configs/train.yaml is the project's with
the ``model:`` and ``data:`` sections emptied (the suite task's defaults); docs/, launch/,
tests/ and the project's top-level files are linked. Commands run in it, so run output
with relative paths lands there, never in the project. ``PROJECT`` is the project
itself: test_task.py checks the user's task there, through its contract only.
"""

from __future__ import annotations

import atexit
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = next(p.parent.name for p in sorted((PROJECT / "src").glob("*/train.py")))
SUITE_TASK = Path(__file__).resolve().with_name("suite_task.py")
LINKED = ("docs", "launch", "tests")        # folders of the project the suite root links
TASK_SECTIONS = ("model", "data")           # the task's sections of configs/train.yaml


def suite_config(text: str) -> str:
    """configs/train.yaml with the task's sections emptied, everything else as it was."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        top = re.match(r"([A-Za-z_][\w-]*)\s*:", line)
        if top:
            skipping = top.group(1) in TASK_SECTIONS
            if skipping:
                out.append(top.group(1) + ": {}          # the suite task's defaults "
                           "(tests/conftest.py)\n")
                continue
        if not skipping or not line.strip():
            out.append(line)
    return "".join(out)


def suite_root(project: Path = PROJECT) -> Path:
    """A copy of ``project`` whose task is the suite's own (see the module docstring)."""
    root = Path(tempfile.mkdtemp(prefix="suite-root-"))
    atexit.register(shutil.rmtree, root, True)    # removes the links, never their targets
    for entry in project.iterdir():
        if entry.is_file() or entry.name in LINKED:
            (root / entry.name).symlink_to(entry)
    for entry in (project / "src").iterdir():
        if entry.name != PACKAGE:
            (root / "src" / entry.name).parent.mkdir(parents=True, exist_ok=True)
            (root / "src" / entry.name).symlink_to(entry)
    package = root / "src" / PACKAGE
    package.mkdir(parents=True)
    for entry in (project / "src" / PACKAGE).iterdir():
        if entry.name not in ("task.py", "__pycache__"):
            (package / entry.name).symlink_to(entry)
    shutil.copyfile(SUITE_TASK, package / "task.py")
    (root / "configs").mkdir()
    for entry in (project / "configs").iterdir():
        if entry.name != "train.yaml":
            (root / "configs" / entry.name).symlink_to(entry)
    config = project / "configs" / "train.yaml"
    (root / "configs" / "train.yaml").write_text(suite_config(config.read_text(encoding="utf-8")),
                                                 encoding="utf-8")
    return root


ROOT = suite_root()


def suite_env() -> dict[str, str]:
    """The environment of a command run in the suite root: its src/ first on the path."""
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["SUITE_ROOT"] = str(ROOT)              # for scripts of tests/ run on their own
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_module(module: str, *args: str, cwd: Path = ROOT, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python -m <package>.<module> args`` in a subprocess."""
    proc = subprocess.run([sys.executable, "-m", f"{PACKAGE}.{module}", *args], cwd=cwd,
                          env=suite_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def torchrun_command(module: str, args: list[str], nproc: int) -> list[str]:
    """The project's own torchrun command line (launch.torchrun_command) for these args.

    The preemption and recovery settings come from configs/train.yaml with the key=value
    arguments applied, so signals, the shutdown timeout and in-place restarts are what
    the job would really get.
    """
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    config = project_module("config").load_config(ROOT / "configs/train.yaml", overrides)
    return project_module("launch.torchrun").torchrun_command(
        module, list(args), config.preemption, nproc_per_node=nproc,
        max_restarts=config.recovery.max_restarts, warm_start=config.recovery.warm_start)


def torchrun(nproc: int, module: str, *args: str, cwd: Path = ROOT, timeout: float = 300,
             check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m <package>.<module> args`` on CPU (gloo)."""
    cmd = torchrun_command(module, list(args), nproc)
    proc = subprocess.run(cmd, cwd=cwd, env=suite_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_metrics(log_dir: Path) -> list[dict]:
    """Every event in ``log_dir/metrics.jsonl``, read by the project's own reader."""
    return project_module("runtime.metrics").read_events(log_dir)[0]


@pytest.fixture
def run_dirs(tmp_path: Path) -> dict[str, str]:
    """Checkpoint and log directories of a throwaway run, as key=value overrides."""
    return {"ckpt": str(tmp_path / "ckpt"), "logs": str(tmp_path / "logs")}


def overrides_for(*base: str):
    """A test file's ``overrides(dirs, *extra)``: its ``base`` settings, then the
    checkpoint.dir and log.dir of ``dirs`` (a ``run_dirs``), then ``extra``."""
    def overrides(dirs: dict[str, str], *extra: str) -> list[str]:
        return [*base, f"checkpoint.dir={dirs['ckpt']}", f"log.dir={dirs['logs']}", *extra]
    return overrides


@pytest.fixture
def ckpt():
    """The layout's modules: (checkpoint.store.layout, checkpoint.store.storage)."""
    return project_module("checkpoint.store.layout"), project_module("checkpoint.store.storage")


# ------------------------------------------------------- long-running jobs --

def project_module(name: str):
    """Import ``<package>.<name>`` from the suite root's src/ (e.g. its launch builder):
    the project's harness modules, and the suite's own task as ``task``."""
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return importlib.import_module(f"{PACKAGE}.{name}")


def start(module: str, *args: str, log_file: Path, nproc: int | None = None,
          cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m <package>.<module> args`` without waiting for it.

    With ``nproc``, start it under torchrun, with the command line built by the project's
    own ``launch.torchrun_command`` from the same overrides, so that SIGUSR1 is forwarded
    and the shutdown timeout fits the grace period. The job gets a session of its own, so
    a test can signal its top process alone, as a scheduler does. stdout and stderr go
    to ``log_file``; ``env`` adds variables to its environment.
    """
    if nproc is None:
        cmd = [sys.executable, "-m", f"{PACKAGE}.{module}", *args]
    else:
        cmd = torchrun_command(module, list(args), nproc)
    with open(log_file, "w", encoding="utf-8") as out:
        return subprocess.Popen(cmd, cwd=cwd, env={**suite_env(), **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_until(condition, proc: subprocess.Popen, what: str, timeout: float = 180,
               log_file: Path | None = None):
    """Poll ``condition()`` until it returns something truthy, and return that.

    Fails if the job exits first or ``timeout`` seconds pass (with the job's log).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.002)
    log = log_file.read_text(errors="replace")[-6000:] if log_file else ""
    state = f"exited {proc.returncode}" if proc.poll() is not None else f"still running after {timeout:g} s"
    raise AssertionError(f"waiting for {what}: job {state}\n{log}")


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for a started job; if it hangs, stop it (workers included) and fail."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun passes SIGTERM on to its workers (each in a session of its own).
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise AssertionError(f"job did not exit within {timeout:g} s") from None


def read_events(log_dir: Path, kind: str) -> list[dict]:
    """The events of one kind in ``metrics.jsonl`` (empty while the file does not exist)."""
    return project_module("runtime.metrics").read_events(log_dir, kind)[0]


# ------------------------------------------------------ processes, from /proc --
# Linux only, like the tests that use them.

def parents() -> dict[int, int]:
    """Every process's parent: {pid: parent pid}."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            table[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # exited meanwhile
    return table


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    return [child for child, parent in parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: children, grandchildren, ..."""
    table = parents()

    def below(p: int) -> bool:
        while p > 1:
            p = table.get(p, 0)
            if p == pid:
                return True
        return False

    return [p for p in table if below(p)]


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` (NUL-separated), or b"" once it has exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rank_of(pid: int) -> str | None:
    """The RANK in the environment of ``pid`` (a torchrun worker), or None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return item[5:].decode()
    return None


def forked_children(pid: int) -> list[int]:
    """Children of ``pid`` forked from it (same command line): its DataLoader workers.
    DCP's checkpoint process is spawned, with a command line of its own."""
    return [child for child in children(pid) if cmdline(child) == cmdline(pid)]


def checkpoint_process_rank(pid: int) -> str | None:
    """The rank whose DCP checkpoint process ``pid`` is, or None: a spawned one
    (``spawn_main``) has the worker's environment, a forked one (warm start) the name
    ``checkpoint-<rank>``."""
    line = cmdline(pid)
    if b"spawn_main" in line and b"resource_tracker" not in line:
        return rank_of(pid)
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return name.split("-", 1)[1] if name.startswith("checkpoint-") else None


def gone(pid: int) -> bool:
    """Exited: no longer listed, or a zombie waiting for its parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until every pid is gone; fails after ``timeout``, killing what is left."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if all(map(gone, pids)):
            return time.monotonic() - began
        time.sleep(0.05)
    alive = {pid: cmdline(pid)[:80] for pid in pids if not gone(pid)}
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"still alive {timeout:g} s later: {alive}")


# ------------------------------------------------------------------ slow tests --

def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (several torchrun jobs each)")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked slow unless --run-slow is given or -m selects by marker.

    They are skipped, not deselected, so the summary says what did not run and how to run it.
    """
    if config.getoption("--run-slow") or config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow (several torchrun jobs): run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------- S3 (moto) --

def moto_s3(monkeypatch, bucket: str):
    """Start a local moto S3 server holding ``bucket``, point every client's environment at
    it, and return the server (the caller stops it)."""
    server_mod = pytest.importorskip("moto.server")
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    # fsspec keeps one client per set of arguments, not per environment: a client made in
    # this process for an earlier test's server would still point there.
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}",
                       "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
    return server
