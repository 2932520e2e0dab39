"""launch/slurm.sbatch under a real Slurm: slurmctld and slurmd on this machine.

What the batch script must do with each way a Slurm job ends (docs/PREEMPTION.md,
"Slurm"): the time limit's USR1 warning saves, requeues and the requeued job finishes
with every step exactly once; a plain `scancel` saves and stays cancelled; a SIGTERM to
the batch shell alone (`scancel --signal=TERM --batch`) saves and requeues; a SIGKILLed
job step (exit 137) is requeued. Skipped, with the reason, only where Slurm cannot be
installed (tests/slurm_cluster.py installs Debian's slurm-wlm and munge as root).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import Cluster, reason_unavailable

from conftest import events, free_port, render

pytestmark = pytest.mark.slow

# One CPU rank; steps of ~0.1 s, saves every 20 steps.
TRAIN = ["model.d_model=128", "model.n_layers=2", "checkpoint.interval_steps=20",
         "log.every_steps=20", "eval.at_end=false"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = reason_unavailable()
    if why is not None:
        print(f"real-Slurm tests skipped: {why}", file=sys.stderr)
        pytest.skip(why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        left = cluster.kill_leftovers()
    # Every process the cluster started ends with it (issue 46): here, not after the suite.
    assert not left, "still running after the cluster stopped (killed now):\n" + "\n".join(left)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    # CPU nodes (gpus_per_node 0) with this machine's 2 cores; a grace period of 20 s.
    return render(tmp_path_factory.mktemp("slurm_project") / "p", launchers=["slurm"],
                  gpus_per_node=0, cpus_per_node=2, grace_period_seconds=20.0)


def submit(slurm: Cluster, project: Path, run: Path, *args: str, sbatch=()) -> str:
    """sbatch launch/slurm.sbatch from the project directory, as the README says."""
    proc = slurm.run("sbatch", "--parsable", *sbatch, "launch/slurm.sbatch", *TRAIN, *args,
                     f"checkpoint.dir={run / 'ckpt'}", f"log.dir={run / 'logs'}",
                     cwd=project, env={"PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": str(project / "src"),
                                       # Another cluster's job (a second xdist worker's)
                                       # has the same id, so the same default port.
                                       "RDZV_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def steps_done(run: Path) -> int:
    return max((e["step"] for e in events(run / "logs", "step")), default=0)


def output(project: Path, job: str) -> str:
    path = project / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def ended(fields: dict) -> bool:
    return fields.get("JobState") in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT")


def training(slurm: Cluster, project: Path, run: Path, job: str, after_step: int) -> None:
    slurm.wait_for(job, lambda f: steps_done(run) >= after_step or ended(f),
                   f"step {after_step}", timeout=120)
    assert steps_done(run) >= after_step, output(project, job)[-3000:]


def test_the_time_limit_warning_saves_requeues_and_the_job_finishes_each_step_once(
        slurm, project, tmp_path):
    run = tmp_path / "run"
    # Slurm sends USR1 60 s (or, by its timer's period, up to about 30 s more) before the
    # 2-minute limit: the first run stops there, commits and exits 75; the script requeues.
    job = submit(slurm, project, run, "train.max_steps=900",
                 sbatch=("--time=2", "--signal=B:USR1@60"))
    slurm.wait_for(job, lambda f: f.get("Restarts") == "1" or ended(f), "the requeue",
                   timeout=150)
    assert "preempted with the state saved: requeueing job" in output(project, job), \
        output(project, job)[-3000:]
    [stop] = events(run / "logs", "preemption")
    assert stop["source"] == "SIGUSR1"
    # The requeued job would wait ~2 minutes (BeginTime): let it start now, unhurried. Not
    # in the second it was requeued: slurmd compares a job's credential with the time its
    # previous one was revoked in whole seconds, and refused a start in that same second
    # ("Job credential revoked": the job FAILED without running, seen once in CI).
    slurm.wait_for(job, lambda f: f.get("JobState") == "PENDING" or ended(f), "pending again",
                   timeout=60)
    time.sleep(2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10")
    done = slurm.wait_for(job, ended, "the end of the requeued job", timeout=300)
    assert done["JobState"] == "COMPLETED", output(project, job)[-3000:]
    steps = [e["step"] for e in events(run / "logs", "step")]
    assert sorted(steps) == list(range(1, 901)), "every step exactly once"
    assert len(events(run / "logs", "start")) == 2


def test_scancel_saves_and_the_job_stays_cancelled(slurm, project, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm, project, run, "train.max_steps=100000")
    training(slurm, project, run, job, after_step=30)
    slurm.run("scancel", job)
    fields = slurm.wait_for(job, ended, "the end", timeout=90)
    text = output(project, job)
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", text[-3000:]
    assert "was cancelled (scancel): not requeueing" in text, text[-3000:]
    [stop] = events(run / "logs", "preemption")
    assert (run / "ckpt" / f"step_{stop['stop_step']:09d}" / "commit.json").is_file()
    assert slurm.job(job)["JobState"] == "CANCELLED"   # and nothing brought it back


def test_a_sigterm_to_the_batch_shell_saves_and_requeues(slurm, project, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm, project, run, "train.max_steps=100000")
    training(slurm, project, run, job, after_step=30)
    slurm.run("scancel", "--signal=TERM", "--batch", job)
    slurm.wait_for(job, lambda f: f.get("Restarts") == "1" or ended(f), "the requeue",
                   timeout=90)
    text = output(project, job)
    assert "preempted with the state saved: requeueing job" in text, text[-3000:]
    [stop] = events(run / "logs", "preemption")
    assert (run / "ckpt" / f"step_{stop['stop_step']:09d}" / "commit.json").is_file()
    slurm.run("scancel", job)


def test_a_killed_job_step_is_requeued(slurm, project, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm, project, run, "train.max_steps=100000")
    training(slurm, project, run, job, after_step=30)
    slurm.run("scancel", "--signal=KILL", f"{job}.0")   # as the OOM killer would
    slurm.wait_for(job, lambda f: f.get("Restarts") == "1" or ended(f), "the requeue",
                   timeout=90)
    assert "the training step was killed (exit 137" in output(project, job), \
        output(project, job)[-3000:]
    slurm.run("scancel", job)
