"""Rendering: every answer set gives a complete, lint-clean project whose own tests pass."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from conftest import package_of, render, run_in

UNUSUAL = {
    "all-launchers-aws-ddp-sync": {
        "project_name": "Spot Trainer", "launchers": ["slurm", "kubernetes", "skypilot"],
        "cloud": "aws", "parallelism": "ddp", "async_mode": "sync", "keep_last": 1},
    "gcp-thread-odd-name": {
        "project_name": "x_9-Lab run", "package_name": "_lab9", "cloud": "gcp", "async_mode": "thread",
        "checkpoint_dir": "/mnt/persistent/ckpt", "docs_language": "zh"},
    "azure-tiny-mtbi-url": {
        "project_name": "az", "cloud": "azure", "mtbi_hours": 0.05, "step_time_seconds": 30.0,
        "checkpoint_save_seconds": 600.0, "restart_seconds": 0.0, "badput_target_percent": 1.0,
        "checkpoint_dir": "s3://bucket/runs/a", "grace_period_seconds": 120.0},
}
JINJA_LEFTOVER = re.compile(r"{{|}}|{%|%}|\.jinja$")


def rendered_files(project: Path) -> list[Path]:
    return [p for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def assert_complete(project: Path) -> None:
    package = package_of(project)
    for name in ("configs/train.yaml", "pyproject.toml", "README.md", ".copier-answers.yml",
                 f"src/{package}/train.py", f"src/{package}/checkpoint/save/pipeline.py",
                 "tests/conftest.py"):
        assert (project / name).is_file(), name
    for path in rendered_files(project):
        assert not path.name.endswith(".jinja"), path
        text = path.read_text(encoding="utf-8")
        assert not JINJA_LEFTOVER.search(text), f"unrendered Jinja in {path}"
    config = yaml.safe_load((project / "configs/train.yaml").read_text())
    assert config["checkpoint"]["interval_steps"] >= 1
    tomllib.loads((project / "pyproject.toml").read_text())


def test_default_render_is_complete(default_project):
    assert_complete(default_project)
    answers = yaml.safe_load((default_project / ".copier-answers.yml").read_text())
    assert answers["package_name"] == "my_run" and "_src_path" in answers


@pytest.mark.parametrize("which", ["default_project", "full_project"])
def test_generated_code_is_lint_clean(which, request):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    proc = subprocess.run([ruff, "check", "--no-cache", "src", "tests"],
                          cwd=request.getfixturevalue(which),
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("which", ["default_project", "full_project"])
def test_no_module_is_over_400_lines(which, request):
    """A module that grows past 400 lines holds two concerns: split it (docs/architecture.md)."""
    src = request.getfixturevalue(which) / "src"
    long = {str(p.relative_to(src)): n for p in sorted(src.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_launch_files_follow_the_answers(tmp_path, default_project):
    assert not (default_project / "launch").exists()  # no launcher: no empty folder either
    assert (default_project / "Dockerfile").is_file()
    project = render(tmp_path / "all", launchers=["slurm", "kubernetes", "skypilot"],
                     grace_period_seconds=45.0, project_name="Spot Trainer")
    sbatch = (project / "launch/slurm.sbatch").read_text()
    subprocess.run(["bash", "-n", str(project / "launch/slurm.sbatch")], check=True)
    assert "#SBATCH --signal=B:USR1@75" in sbatch          # grace 45 s + 30 s margin
    assert 'srun "${PYTHON:-python}" -m spot_trainer.resume' in sbatch
    assert "scontrol requeue" in sbatch
    job = next(doc for doc in yaml.safe_load_all((project / "launch/kubernetes.yaml").read_text())
               if doc["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 75
    rules = job["spec"]["podFailurePolicy"]["rules"]
    ignored = [r["onExitCodes"]["values"] for r in rules
               if r["action"] == "Ignore" and "onExitCodes" in r]
    # The preemption exit code the config was rendered with, and 74: a node lost.
    assert ignored == [[75, 74]]
    config = yaml.safe_load((project / "configs/train.yaml").read_text())
    assert config["preemption"]["exit_code"] == 75
    sky = yaml.safe_load((project / "launch/skypilot.yaml").read_text())
    assert sky["resources"]["use_spot"] is True and "spot_trainer.resume" in sky["run"]
    # The copy-time figure is the one the generated launcher computes at run time.
    probe = ("from spot_trainer.config import load_config; from spot_trainer.launch.torchrun import "
             "shutdown_timeout_s; print(shutdown_timeout_s(load_config().preemption))")
    assert run_in(project, "-c", probe).stdout.strip() == "75"
    dockerfile = (project / "Dockerfile").read_text()
    assert '"spot_trainer.resume"' in dockerfile


def test_default_project_fast_tier_passes(default_project, request):
    """The generated suite without its slow tests (make check's share of it)."""
    if "not slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("the whole generated suite runs in test_full_project_own_test_suite_passes")
    proc = run_in(default_project, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                  *(["-n", "2"] if importlib.util.find_spec("xdist") else []), timeout=900)
    assert " passed" in proc.stdout and " failed" not in proc.stdout


# The slow tier of a render with every optional part (conftest.FULL; its fast tier runs
# once, in the upgrade test, tests/test_update.py, and the default render's in make
# check), in two halves of about the same length, one per xdist worker (conftest puts
# them at the head of each worker's queue): the kill loop, the real servers and the
# node-loss drills, and the rest. The drills run fewer rounds here than a generated
# project's own defaults (DRILL_ROUNDS: kills of the kill loop, the phases a SIGTERM
# lands in, the soak's mean time between faults): the defaults are for a run of their own
# (docs/RECOVERY.md's figures), and every kind of check still runs.
FIRST_HALF = {"test_kill_loop.py", "test_object_store.py", "test_tracking.py",
              "test_compile.py", "test_node_loss.py", "test_memory_tier.py",
              "test_stop_phases.py", "test_nodes.py", "test_goodput.py"}
DRILL_ROUNDS = {"KILL_LOOP_KILLS": "3", "STOP_PHASES": "resume-imports,loaded,saving",
                "SOAK_MTBI_SECONDS": "10"}
# The short form of test_compiled_and_eager_runs_resume_each_other, for the torch legs
# (tests/torch_leg.py): every check it makes (the same keys, none "_orig_mod.", inductor
# built code) the long form makes too, which runs here. Its own cold build: 63 s.
ONLY_FOR_THE_LEGS = ["tests/test_compile.py::test_a_compiled_run_saves_the_keys_an_eager_run_saves"]


@pytest.mark.slow
@pytest.mark.parametrize("half", ["first", "second"])
def test_full_project_own_test_suite_passes(full_project, tmp_path, half):
    files = sorted(p.name for p in (full_project / "tests").glob("test_*.py"))
    assert FIRST_HALF <= set(files)
    for test in ONLY_FOR_THE_LEGS:   # a renamed test would run here again, unseen
        path, name = test.split("::")
        assert f"def {name}(" in (full_project / path).read_text(), test
    chosen = [f for f in files if (f in FIRST_HALF) == (half == "first")]
    env = dict(os.environ, PYTHONPATH=str(full_project / "src"), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", **DRILL_ROUNDS)
    log = tmp_path / f"{half}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
             "-m", "slow", "--durations=30", "--basetemp", str(tmp_path / half),
             *[arg for test in ONLY_FOR_THE_LEGS for arg in ("--deselect", test)],
             *[f"tests/{f}" for f in chosen]],
            cwd=full_project, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        code = proc.wait(timeout=3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    assert code == 0, f"the {half} half exited {code}:\n" + log.read_text()[-6000:]


# make test renders and trains every set (about 30 s each); make check renders unusual
# answers in test_questions.py and test_checklist.py, and stays within its 5 minutes.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(UNUSUAL))
def test_unusual_answers_render_and_train(tmp_path, name):
    answers = UNUSUAL[name]
    project = render(tmp_path / "p", **answers)
    assert_complete(project)
    config = yaml.safe_load((project / "configs/train.yaml").read_text())
    assert config["checkpoint"]["dir"] == answers.get("checkpoint_dir", "checkpoints")
    assert config["checkpoint"]["async_mode"] == answers.get("async_mode", "process")
    assert config["distributed"]["parallelism"] == answers.get("parallelism", "fsdp")
    assert config["preemption"]["notice_source"] == answers["cloud"]
    # The quick part of the generated suite (no multi-rank runs) exercises every module,
    # and the checklist's measured section in the render's language.
    # Left out: the checks of the task's own sections and the help of every command but
    # train, a process each (2 s of torch import apiece) whose answers do not depend on
    # these answers; the default render's suite runs them all.
    proc = run_in(project, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                  "tests/test_config.py", "tests/test_sampling.py",
                  "tests/test_checkpoint_layout.py",
                  "tests/test_plan.py::test_write_refreshes_only_the_measured_section",
                  "tests/test_ledger.py::test_the_checklists_measured_section_shows_the_ledger",
                  "-k",
                  "not tasks_sections_are_checked and not answer_help or answer_help and train")
    assert " passed" in proc.stdout
    if not answers.get("checkpoint_dir", "").startswith("s3://"):
        pkg = package_of(project)
        proc = run_in(project, "-m", f"{pkg}.train", "train.max_steps=4",
                      "checkpoint.interval_steps=2", f"checkpoint.dir={tmp_path / 'ck'}",
                      f"log.dir={tmp_path / 'logs'}", "model.d_model=32")
        assert "finished at step 4" in proc.stdout


@pytest.mark.slow
def test_a_ddp_render_trains_resumes_and_syncs_gradients(tmp_path):
    """The multi-rank training and resume tests on a DDP render: a 2-rank run resumed on 1
    rank must match it, which fails when the ranks never synchronise their gradients."""
    project = render(tmp_path / "ddp", parallelism="ddp")
    proc = run_in(project, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--run-slow",
                  "tests/test_train.py", "tests/test_resume.py", "-k",
                  "two_ranks or bit_identical or drill_two_ranks")
    assert " passed" in proc.stdout and " failed" not in proc.stdout
