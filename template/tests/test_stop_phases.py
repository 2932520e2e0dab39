"""A stop in any phase of a start ends as a preemption: exit 75, no traceback, and the
newest checkpoint intact.

``resume`` is signalled (SIGTERM, as a scheduler does) while the start is in one phase:
its own imports, the workers' imports, the rendezvous, building the model, loading the
checkpoint, the first step, steady training, a save in flight. To land inside a phase,
the workers pause in it: a ``sitecustomize`` of the test's own (on PYTHONPATH, so every
process of the job imports it; none of the project's code knows of it) wraps
``runtime.phases.mark`` and, for the workers' imports, the import of ``loop.job`` (in the
zygote under warm start: what its workers wait for).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PACKAGE, ROOT, project_module, read_events, run_module, suite_env

pytestmark = pytest.mark.slow

SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=1", "eval.at_end=false"]
PAUSE_S = 4.0

HOOK = '''
import importlib.abc, importlib.util, os, sys, time

PAUSE = os.environ.get("STOP_TEST_PAUSE_AT")
FLAG = os.environ.get("STOP_TEST_FLAG")
PACKAGE = os.environ.get("STOP_TEST_PACKAGE")


def pause():
    if os.environ.get("RANK", "0") == "0":   # rank 0, or the zygote (RANK not set)
        open(FLAG, "w").close()
    time.sleep(float(os.environ.get("STOP_TEST_PAUSE_S", "6")))


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        wanted = {PACKAGE + ".runtime.phases": "phases", PACKAGE + ".loop.job": "job"}
        if name not in wanted:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            if wanted[name] == "job" and PAUSE == "imports":
                pause()
            run(module)
            if wanted[name] == "phases":
                mark = module.mark

                def paused(phase, at=None):
                    mark(phase, at)
                    if phase.value == PAUSE and "RANK" in os.environ:
                        pause()
                module.mark = paused

        spec.loader.exec_module = exec_module
        return spec


# Workers, and the zygote they are forked from under warm start (whose environment has
# no RANK; it alone imports loop.job there, so "imports" pauses it).
if PAUSE and ("RANK" in os.environ or "launch.zygote" in " ".join(sys.orig_argv)):
    sys.meta_path.insert(0, Finder())
'''


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint directory with committed checkpoints (steps 4 and 8)."""
    root = tmp_path_factory.mktemp("trained")
    run_module("train", *SMALL, "train.max_steps=8", "checkpoint.interval_steps=4",
               "checkpoint.async_mode=sync", f"checkpoint.dir={root / 'ckpt'}",
               f"log.dir={root / 'logs'}")
    return root / "ckpt"


def committed(ckpt: Path) -> list[int]:
    checkpoint = project_module("checkpoint")
    return [c.step for c in checkpoint.list_committed(checkpoint.open_storage(str(ckpt)),
                                                        warn=False)]


def start_resume(tmp_path: Path, ckpt: Path, pause_at: str | None,
                 *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = suite_env()
    env["PYTHONPATH"] = str(hook) + os.pathsep + env["PYTHONPATH"]
    flag = tmp_path / "paused"
    env.update(STOP_TEST_PAUSE_AT=pause_at or "", STOP_TEST_FLAG=str(flag),
               STOP_TEST_PACKAGE=PACKAGE, STOP_TEST_PAUSE_S=str(PAUSE_S))
    log = tmp_path / "job.log"
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"{PACKAGE}.resume", "--nproc-per-node", "2", *SMALL,
             "train.max_steps=100000", f"checkpoint.dir={ckpt}", f"log.dir={tmp_path / 'logs'}",
             *extra], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    return proc, flag, log


def wait_for(condition, proc: subprocess.Popen, log: Path, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        assert proc.poll() is None, f"exited {proc.returncode} before {what}\n{log.read_text()}"
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"no {what} within {timeout:g} s\n{log.read_text()[-4000:]}")


PHASES = ["resume-imports", "imports", "rendezvous_done", "model_built", "loaded",
          "first_step", "steady", "saving"]


# STOP_PHASES=name,name runs only those (the template's own CI runs a few; a project's
# suite runs every phase).
CHOSEN = [p for p in os.environ.get("STOP_PHASES", "").split(",") if p] or PHASES


@pytest.mark.parametrize("phase", CHOSEN)
def test_sigterm_in_each_phase_of_a_start_is_a_clean_preemption(phase, trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    before = committed(ckpt)
    paused = phase not in ("resume-imports", "steady", "saving")
    extra = ["checkpoint.interval_steps=1"] if phase == "saving" else []
    proc, flag, log = start_resume(tmp_path, ckpt, phase if paused else None, *extra)
    logs = tmp_path / "logs"
    if phase == "resume-imports":
        time.sleep(0.3)              # resume itself is still importing torch
    elif phase == "steady":
        wait_for(lambda: len(read_events(logs, "step")) >= 5, proc, log, "five steps")
    elif phase == "saving":
        wait_for(lambda: [e for e in read_events(logs, "save") if e["step"] > before[-1]],
                 proc, log, "a save of this start")
    else:
        wait_for(flag.exists, proc, log, f"the pause after {phase}")
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"resume did not end within 120 s\n{log.read_text()}") from None
    output = log.read_text()
    assert status == 75, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    after = committed(ckpt)
    assert after[-1] >= before[-1], (before, after)
    check = run_module("verify", f"checkpoint.dir={ckpt}", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
