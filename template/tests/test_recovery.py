"""Recovery from failures that are not preemptions (docs/RECOVERY.md).

In-place restarts by torchrun after a worker dies, the step watchdog for a hung rank,
the no-progress guard that stops retrying (straggler detection: test_stragglers.py, rendered
with it). The jobs run
through ``resume`` with 2 CPU ranks, as a launcher runs them; the tests that need a
failing or slow task run a copy of the project whose task.py has a test hook appended
(nothing in the harness knows about it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    PACKAGE,
    ROOT,
    descendants,
    finish,
    project_module,
    read_events,
    wait_until,
)

exit_codes = project_module("runtime.exit_codes")
exits = project_module("recovery.attempts")
SMALL = ["model.d_model=32", "model.n_layers=1", "model.dropout=0.1", "log.every_steps=1000",
         "train.global_batch_size=16", "train.micro_batch_size=2",
         "checkpoint.async_mode=sync", "checkpoint.interval_steps=4"]


# ----------------------------------------------------------------- helpers --
def project_copy(tmp_path: Path, hook: str = "") -> Path:
    """The project's src/, configs/ and launch/ in ``tmp_path/project``, with ``hook``
    appended to its task.py (a test's own task, not the harness's)."""
    root = tmp_path / "project"
    for part in ("src", "configs", "launch"):
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, root / part,
                            ignore=shutil.ignore_patterns("__pycache__"))
    if hook:
        with open(root / "src" / PACKAGE / "task.py", "a", encoding="utf-8") as task:
            task.write("\n\n# ---- test hook (tests/test_recovery.py) ----\n" + hook)
    return root


def env_for(root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def start_resume(root: Path, base: Path, *args: str, env: dict[str, str] | None = None,
                 log_name: str = "job.log") -> tuple[subprocess.Popen, Path]:
    """``resume --nproc-per-node 2`` in a session of its own; output to base/log_name."""
    base.mkdir(parents=True, exist_ok=True)
    log = base / log_name
    cmd = [sys.executable, "-m", f"{PACKAGE}.resume", "--nproc-per-node", "2",
           "--config", str(root / "configs" / "train.yaml"), *SMALL,
           f"checkpoint.dir={base / 'ckpt'}", f"log.dir={base / 'logs'}", *args]
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env or env_for(root), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def worker(resume_pid: int, rank: int, logs: Path) -> int:
    """The pid of the process that trains ``rank`` below ``resume_pid``: the one its rank
    record names (forked from the zygote under warm start, torchrun's child when cold)."""
    below = set(descendants(resume_pid))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for record in exits.read_records(logs):
            if (record.get("rank") == rank and record.get("state") == "running"
                    and int(record["pid"]) in below):
                return int(record["pid"])
        time.sleep(0.05)
        below = set(descendants(resume_pid))
    raise AssertionError(f"no worker of rank {rank} below pid {resume_pid}")


def losses(logs: Path) -> dict[int, set[float]]:
    """Every loss logged for each step (a step run twice, before and after a restart,
    has two entries unless they are identical)."""
    found: dict[int, set[float]] = {}
    for event in read_events(logs, "step"):
        found.setdefault(event["step"], set()).add(event["loss"])
    return found


# ------------------------------------------------------------ fast checks --
@pytest.mark.torch_api
def test_torchrun_command_restarts_in_place_with_a_fresh_store_per_attempt():
    config = project_module("config").load_config(ROOT / "configs/train.yaml")
    launch = project_module("launch.torchrun")
    cmd = launch.torchrun_command("train", [], config.preemption, nproc_per_node=2,
                                  max_restarts=config.recovery.max_restarts)
    assert f"--max-restarts={config.recovery.max_restarts}" in cmd
    assert cmd[:2] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
    plain = launch.torchrun_command("train", [], config.preemption, nproc_per_node=2,
                                    max_restarts=0)
    assert "--max-restarts=0" in plain and plain[0] == sys.executable


@pytest.mark.parametrize("override, message", [
    ("recovery.max_restarts=-1", "recovery.max_restarts must be >= 0"),
    ("recovery.step_timeout_s=-5", "recovery.step_timeout_s must be a finite number"),
    ("recovery.straggler_ratio=1", "recovery.straggler_ratio must be a finite number > 1"),
    ("preemption.exit_code=74", "preemption.exit_code must be in 3..127 and not 73, 74, 79"),
    ("plan.crash_share=1.5", "plan.crash_share must be a number between 0 and 1"),
])
def test_bad_recovery_settings_are_refused(override, message):
    config = project_module("config")
    with pytest.raises(config.ConfigError, match=message):
        config.load_config(ROOT / "configs/train.yaml", [override])


@pytest.mark.torch_api
def test_watchdog_dumps_every_stack_and_exits_hung(capfd):
    exited: list[int] = []
    hangs: list[tuple] = []
    watchdog = project_module("recovery.watchdog").StepWatchdog(
        rank=3, step_timeout_s=0.3, first_step_timeout_s=0.3,
        on_hang=lambda *args: hangs.append(args), exit=exited.append)
    watchdog.start(7)
    for step in (8, 9, 10):
        time.sleep(0.1)
        watchdog.beat(step, 0.1)
    began = time.monotonic()
    while not exited and time.monotonic() - began < 5:
        time.sleep(0.01)
    assert exited == [exit_codes.HUNG] and 0.25 < time.monotonic() - began < 2.0
    assert hangs and hangs[0][0] == 10
    err = capfd.readouterr().err
    assert "rank 3: no step finished" in err and "most recent call first" in err
    assert "test_watchdog_dumps_every_stack_and_exits_hung" in err   # the main thread's stack


def test_watchdog_bounds_first_steps_and_then_follows_the_step_time():
    watchdog = project_module("recovery.watchdog")
    dog = watchdog.StepWatchdog(rank=0, step_timeout_s=0, first_step_timeout_s=600)
    assert dog.timeout_s() == 600                      # the first step
    for step in range(1, watchdog.AUTO_AFTER_STEPS):
        dog.beat(step, 0.5)
    assert dog.timeout_s() == 600                      # not yet 20 steps measured
    dog.beat(20, 0.5)
    assert dog.timeout_s() == watchdog.AUTO_MIN_S      # max(60 s, 10 x 0.5 s)
    for step in range(21, 60):
        dog.beat(step, 9.0)
    assert dog.timeout_s() == 90.0                     # 10 x the median
    fixed = watchdog.StepWatchdog(rank=0, step_timeout_s=5, first_step_timeout_s=600)
    fixed.beat(1, 0.1)
    assert fixed.timeout_s() == 5


def record(rank: int, state: str, **fields) -> dict:
    return {"rank": rank, "state": state, "host": "h", "pid": 100 + rank, "run_id": "r",
            "restart": 0, "started": 1000.0, "time": 1010.0 + rank, "step": 5, **fields}


def test_the_cause_names_the_rank_that_died_without_a_word():
    cause = exits.cause([record(0, "crashed", status=1, reason="RuntimeError: reset by peer"),
                         record(1, "running")])
    assert (cause["kind"], cause["rank"], cause["failed_at"]) == ("lost", 1, 1010.0)
    assert "rank 1 ended without a word" in cause["summary"]
    assert "rank 0 crashed at step 5: RuntimeError" in cause["summary"]
    assert exits.cause([record(0, "running"), record(1, "running")])["kind"] == "killed"
    hang = exits.cause([record(0, "hung", status=exit_codes.HUNG, reason="no step"),
                        record(1, "crashed", status=1, reason="x")])
    assert (hang["kind"], hang["rank"], hang["status"]) == ("hang", 0, exit_codes.HUNG)
    done = exits.cause([record(0, "ended", status=130, reason="interrupted by the user")])
    assert (done["kind"], done["signal"], done["failed_at"]) == ("exit", "SIGINT", None)


def test_the_guard_counts_failed_starts_without_progress_and_resets_on_a_checkpoint(tmp_path):
    storage = project_module("checkpoint").LocalStorage(tmp_path)
    guard = project_module("recovery.progress_guard").ProgressGuard(storage, limit=3)

    def failed(n: int, newest_at_start: int) -> dict:
        return {"kind": "crash", "attempt": f"a{n}", "summary": f"crash {n}",
                "newest_step": newest_at_start}

    assert guard.on_start(8, None) == (0, None) and guard.read() is None
    assert guard.on_start(8, failed(1, 8)) == (1, None)
    assert guard.on_start(8, failed(1, 8)) == (1, None)     # the same start, counted once
    assert guard.on_start(8, {"kind": "killed", "attempt": "k"}) == (1, None)
    assert guard.on_start(8, {"kind": "exit", "status": 75, "attempt": "e"}) == (1, None)
    assert guard.on_start(8, {"kind": "exit", "status": 73, "attempt": "n",
                              "summary": "saves failed", "newest_step": 8}) == (2, None)
    count, refusal = guard.on_start(8, failed(3, 8))
    assert count == 3 and "3 start(s) in a row failed" in refusal
    assert "crash 1 | saves failed | crash 3" in refusal and "progress.json" in refusal
    assert guard.on_start(8, None)[1] is not None          # and every start after it
    assert guard.on_start(12, failed(4, 8)) == (0, None)   # it committed step 12 first
    assert guard.read() is None                             # no file while nothing is counted
    off = project_module("recovery.progress_guard").ProgressGuard(storage, limit=0)
    for n in range(5):
        assert off.on_start(12, failed(10 + n, 12))[1] is None


def test_the_plan_tells_in_place_restarts_from_reschedules(tmp_path, capsys):
    model = project_module("interval.formulas")
    inputs = model.Inputs(8, 2, 10, 10, 120, 5, crash_share=0.25)
    plan = model.make_plan(inputs, in_place_restart_seconds=12)
    # Written from the formula, not from interval/formulas.py: S = c(R - R_in)/M.
    assert plan.in_place_saving == pytest.approx(0.25 * (120 - 12) / (8 * 3600))
    assert plan.expected_badput_with_in_place == pytest.approx(
        plan.expected_badput - plan.in_place_saving)
    assert model.make_plan(inputs).in_place_saving is None
    metrics = tmp_path / "metrics.jsonl"
    events = [{"event": "step", "step": n, "step_time_s": 2.0} for n in range(1, 5)]
    events += [{"event": "save", "step": 4, "reason": "interval", "blocking_s": 1.0,
                "commit_latency_s": 2.0}]
    events += [{"event": "recovered", "in_place": True, "failure_to_first_step_s": s}
               for s in (9.0, 7.0, 30.0)]
    events += [{"event": "recovered", "in_place": False, "failure_to_first_step_s": 500.0}]
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events))
    measured = model.read_metrics(metrics)
    assert (measured.in_place_restart_seconds, measured.in_place_restart_count) == (9.0, 3)
    code = project_module("tools.plan").main(["--metrics", str(metrics), "--json", "--mtbi-hours",
                                        "8", "--restart-seconds", "120", "--crash-share", "0.5",
                                        "--badput-target-percent", "5"])
    got = json.loads(capsys.readouterr().out)
    assert code == 0 and got["in_place_restart_seconds"] == 9.0
    assert got["inputs"]["crash_share"] == 0.5
    assert got["in_place_saving_percent"] == pytest.approx(100 * 0.5 * (120 - 9) / 28800)


def test_resume_passes_the_do_not_retry_status_through(tmp_path):
    resume, config = project_module("launch.supervisor"), project_module("config")
    storage = project_module("checkpoint").LocalStorage(tmp_path)
    code = resume.exit_status(1, storage, None, config.PreemptionConfig(), [],
                              training_status=(exit_codes.NO_PROGRESS, "no progress"))
    assert code == exit_codes.NO_PROGRESS


def test_a_node_loss_says_where_the_next_run_resumes_from(tmp_path, capsys):
    resume, config = project_module("launch.supervisor"), project_module("config")
    storage = project_module("checkpoint").LocalStorage(tmp_path)
    for memory_tier in (False, True):
        code = resume.exit_status(1, storage, None, config.PreemptionConfig(), [],
                                  node_lost="node b did not come back",
                                  memory_tier=memory_tier)
        said = capsys.readouterr().err
        assert code == exit_codes.NODE_LOST and "node b did not come back" in said
        assert ("memory copy every rank can still reach" in said) == memory_tier, said
        assert "newest committed checkpoint" in said


# --------------------------------------------------------------- the jobs --
@pytest.mark.slow   # kept out of the quick tier for its time; `make test` runs it
def test_a_status_training_decides_is_not_restarted_in_place(tmp_path):
    """The guard refuses at the first start: the job must end there with 79, not be
    started three more times by torchrun (which restarts on any non-zero exit)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "progress.json").write_text(json.dumps(
        {"newest_step": -1, "failed_starts": 3, "last_counted": "earlier",
         "history": ["rank 0 crashed at step 1: RuntimeError: earlier"]}))
    proc, log = start_resume(ROOT, tmp_path, "train.max_steps=4")
    assert finish(proc, 300) == exit_codes.NO_PROGRESS, log.read_text()[-3000:]
    ends = read_events(tmp_path / "logs", "end")
    assert [(e["status"], e["restart"]) for e in ends] == [(exit_codes.NO_PROGRESS, 0)]
    assert read_events(tmp_path / "logs", "start") == []      # refused before training
    output = log.read_text()
    assert "asking torchrun" in output and "RuntimeError: earlier" in output


@pytest.mark.torch_api
@pytest.mark.slow
def test_a_killed_worker_is_restarted_in_place_and_the_run_stays_exact(tmp_path):
    steps = ["train.max_steps=24"]
    ref, ref_log = start_resume(ROOT, tmp_path / "reference", *steps)
    assert finish(ref, 600) == 0, ref_log.read_text()[-3000:]
    proc, log = start_resume(ROOT, tmp_path / "killed", *steps)
    logs = tmp_path / "killed" / "logs"
    wait_until(lambda: len(read_events(logs, "step")) >= 10, proc, "ten steps", log_file=log)
    os.kill(worker(proc.pid, rank=1, logs=logs), signal.SIGKILL)
    assert finish(proc, 600) == 0, log.read_text()[-3000:]
    reference, got = losses(tmp_path / "reference" / "logs"), losses(logs)
    assert sorted(got) == list(range(1, 25))
    for step, values in got.items():
        assert values == reference[step], (step, values, reference[step])   # bit-identical
    starts = read_events(logs, "start")
    assert [s["restart"] for s in starts] == [0, 1]
    cause = starts[1]["cause"]
    assert (cause["kind"], cause["rank"]) == ("lost", 1) and "rank 0 crashed" in cause["summary"]
    assert starts[1]["resumed_from"] and starts[1]["step"] >= 8
    recovered = read_events(logs, "recovered")
    assert len(recovered) == 1 and recovered[0]["in_place"]
    assert 0 < recovered[0]["failure_to_first_step_s"] < 120
    assert read_events(logs, "end")[-1]["status"] == 0
    # The restart's phases, in order, from the failure to the first step.
    phases = [e for e in read_events(logs, "phase") if e["restart"] == 1]
    on_path = [e for e in phases if not e.get("off_the_path")]
    assert [e["phase"] for e in on_path] == [
        "failure_detected", "workers_stopped", "process_started", "imports_done",
        "rendezvous_done", "model_built", "checkpoint_chosen", "loaded", "first_step"]
    assert all(e["duration_s"] >= -0.05 for e in on_path[1:])
    total = on_path[-1]["at"] - on_path[0]["at"]
    assert abs(total - recovered[0]["failure_to_first_step_s"]) < 1.0, (total, recovered)
    assert [e["phase"] for e in phases if e.get("off_the_path")] in (
        [], ["checkpoint_process_ready"])


@pytest.mark.slow
def test_a_stopped_worker_is_found_by_the_watchdog_and_the_job_finishes(tmp_path):
    timeout = 5.0
    proc, log = start_resume(ROOT, tmp_path, "train.max_steps=30",
                             f"recovery.step_timeout_s={timeout}",
                             "checkpoint.wait_timeout_s=5")
    logs = tmp_path / "logs"
    wait_until(lambda: len(read_events(logs, "step")) >= 6, proc, "six steps", log_file=log)
    stopped = worker(proc.pid, rank=1, logs=logs)
    os.kill(stopped, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        hang = wait_until(lambda: read_events(logs, "hang"), proc, "the watchdog",
                          timeout=120, log_file=log)[0]
        assert finish(proc, 600) == 0, log.read_text()[-3000:]
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)     # torchrun kills it; never leave it stopped
        except ProcessLookupError:
            pass
    # The bound runs from the last step finished, before the stop; the step that saves
    # gets checkpoint.wait_timeout_s and 4 x the measured write time more; the watchdog
    # looks every bound/20; 2 s for the rest.
    writes = [e["write_s"] for e in read_events(logs, "save") if e["time"] < stopped_at]
    assert hang["rank"] == 0
    assert hang["time"] - stopped_at < timeout + 5 + 4 * max(writes, default=0) + 2
    output = log.read_text()
    assert "rank 0: no step finished" in output and "most recent call first" in output
    assert "distributed_c10d.py" in output       # where the main thread was stuck
    starts = read_events(logs, "start")
    assert [s["restart"] for s in starts] == [0, 1]
    assert any(r["state"] == "hung" and r["rank"] == 0 for r in starts[1]["cause"]["ranks"])
    assert sorted(losses(logs)) == list(range(1, 31))


RAISE_HOOK = '''
import os as _os

_loss_and_metrics = loss_and_metrics
_calls = [0]


def loss_and_metrics(model, batch):
    _calls[0] += 1
    if _os.environ.get("RECOVERY_TEST_RAISE") and _calls[0] == 1:
        raise RuntimeError("test hook: this checkpoint makes every start fail")
    return _loss_and_metrics(model, batch)
'''

CRASH_HOOK = '''
import os as _os

_loss_and_metrics_until_the_crash = loss_and_metrics
_micro_batches = [0]


def loss_and_metrics(model, batch):
    _micro_batches[0] += 1
    after = int(_os.environ.get("RECOVERY_TEST_CRASH_AFTER", "0"))
    if after and _micro_batches[0] > after:
        raise RuntimeError("test hook: every start crashes a few steps in")
    return _loss_and_metrics_until_the_crash(model, batch)
'''

FAKE_SLURM = {
    "scontrol": 'if [ "$1" = show ]; then echo localhost; else echo "$@" >> "$FAKE_SLURM_LOG"; fi',
    "sbatch": 'echo "sbatch $*" >> "$FAKE_SLURM_LOG"',
    "srun": ('[ "$1" = python ] && shift && set -- "$FAKE_PYTHON" "$@"\n"$@"\nstatus=$?\n'
             'echo "srun exited $status" >> "$FAKE_SLURM_LOG"\nexit $status'),
}


@pytest.mark.slow
def test_starts_that_fail_without_progress_end_with_the_do_not_retry_status(tmp_path):
    root = project_copy(tmp_path, RAISE_HOOK)
    base = tmp_path / "run"
    first, log = start_resume(root, base, "train.max_steps=4", log_name="first.log")
    assert finish(first, 600) == 0, log.read_text()[-3000:]
    # Every start from here on raises at its first step: torchrun restarts in place
    # (recovery.max_restarts=3) and the fourth start finds three failures counted.
    overrides = [*SMALL, "train.max_steps=8", f"checkpoint.dir={base / 'ckpt'}",
                 f"log.dir={base / 'logs'}"]
    env = env_for(root, RECOVERY_TEST_RAISE="1")
    slurm = root / "launch" / "slurm.sbatch"
    if slurm.is_file():          # through the Slurm script, with fake Slurm commands
        fake = tmp_path / "bin"
        fake.mkdir()
        for name, body in FAKE_SLURM.items():
            (fake / name).write_text("#!/bin/bash\n" + body + "\n")
            (fake / name).chmod(stat.S_IRWXU)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env.update(PATH=f"{fake}:{env['PATH']}", FAKE_SLURM_LOG=str(tmp_path / "slurm.log"),
                   FAKE_PYTHON=sys.executable, SLURM_JOB_ID="4242", SLURM_NNODES="1",
                   SLURM_JOB_NODELIST="localhost", SLURM_GPUS_ON_NODE="2",
                   SLURM_SUBMIT_DIR=str(root), RDZV_PORT=str(port))
        cmd = ["bash", str(slurm), "--config", str(root / "configs" / "train.yaml"), *overrides]
    else:
        cmd = [sys.executable, "-m", f"{PACKAGE}.resume", "--nproc-per-node", "2",
               "--config", str(root / "configs" / "train.yaml"), *overrides]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == exit_codes.NO_PROGRESS, output[-4000:]
    assert "3 start(s) in a row failed without committing a new checkpoint" in output
    assert "test hook: this checkpoint makes every start fail" in output
    starts = read_events(base / "logs", "start")
    assert [s["restart"] for s in starts] == [0, 0, 1, 2]      # the first job, then 3 tries
    assert [s["failed_starts"] for s in starts[1:]] == [0, 1, 2]
    assert read_events(base / "logs", "end")[-1]["status"] == exit_codes.NO_PROGRESS
    progress = json.loads((base / "ckpt" / "progress.json").read_text())
    assert progress["failed_starts"] == 3 and progress["newest_step"] == 4
    if slurm.is_file():
        calls = (tmp_path / "slurm.log").read_text()
        assert f"srun exited {exit_codes.NO_PROGRESS}" in calls
        assert "requeue" not in calls and "sbatch" not in calls, calls


def test_a_start_after_a_failure_lays_out_its_phases_from_the_failure(tmp_path):
    phases = project_module("runtime.phases")
    phases.reset()
    try:
        now = time.time()
        for offset, phase in ((3.0, phases.Phase.imports_done), (3.5, phases.Phase.model_built),
                              (3.7, phases.Phase.loaded), (4.0, phases.Phase.first_step)):
            phases.mark(phase, now + offset)
        phases.mark(phases.Phase.process_started, now + 1.0)
        rows = phases.timeline({"failed_at": now, "stopped_at": now + 0.5})
    finally:
        phases.reset()
    assert [(r["phase"], r["duration_s"]) for r in rows] == [
        ("failure_detected", None), ("workers_stopped", 0.5), ("process_started", 0.5),
        ("imports_done", 2.0), ("model_built", 0.5), ("loaded", 0.2), ("first_step", 0.3)]
    text = phases.breakdown(rows)
    assert "first_step" in text.splitlines()[-1] and "4.00 s" in text.splitlines()[-1]
    assert phases.breakdown([]) == "no start has recorded its phases yet"
