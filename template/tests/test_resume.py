"""Resuming: the restart script, exact continuation, resharding, and the interruption drill.

Resume tests continue a reference run from its own checkpoint of step RESUME_AT (copied
into a directory of its own), so one reference run serves several resumes; that state
is exactly what a run interrupted right after that checkpoint leaves behind. The drill
test adds the real thing: kill -9 of the whole job, then the restart script.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import PACKAGE, ROOT, gone, project_module, run_module, suite_env, torchrun

CONFIG = str(ROOT / "configs" / "train.yaml")
STEPS, RESUME_AT = 8, 4
# Pinned so that the tests do not depend on edits to configs/train.yaml: 16 samples split
# over 1, 2 or 4 ranks of 2, but not over 3.
BATCH = ("train.global_batch_size=16", "train.micro_batch_size=2")
SMALL = ("model.d_model=32", "model.n_layers=1", "log.every_steps=100", *BATCH)


def run_overrides(base: Path, *extra: str) -> list[str]:
    # Synchronous saves: how a save is written does not change the numbers, and it spares
    # each run the background process (the drill test covers that, killed mid-run).
    return [*SMALL, f"train.max_steps={STEPS}", "checkpoint.interval_steps=2",
            "checkpoint.keep_last=10", "checkpoint.async_mode=sync",
            f"checkpoint.dir={base / 'ckpt'}", f"log.dir={base / 'logs'}", *extra]


def reference_run(base: Path, nproc: int, *extra: str) -> Path:
    """An uninterrupted run of STEPS steps on ``nproc`` ranks, a checkpoint every 2 steps."""
    if nproc == 1:
        run_module("train", *run_overrides(base, *extra))
    else:
        torchrun(nproc, "train", *run_overrides(base, *extra))
    return base


def resume_from(reference: Path, base: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    """``resume --nproc-per-node nproc`` from the reference's checkpoint of step RESUME_AT."""
    name = project_module("checkpoint").step_name(RESUME_AT)
    shutil.copytree(reference / "ckpt" / name, base / "ckpt" / name)
    return run_module("resume", "--nproc-per-node", str(nproc), *run_overrides(base, *extra))


def last_run(log_dir: Path) -> tuple[dict, dict[int, dict]]:
    """The start event and the step events of the newest run logged in ``log_dir`` (the
    drill's own reading: a restart that found the run finished is not a run)."""
    run = project_module("tools.drill_report").split_runs(log_dir)[-1]
    return run.start, run.steps


def dry_run(capsys, *args: str) -> tuple[int, str, str]:
    code = project_module("launch.supervisor").main(["--config", CONFIG, "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("ref-dropout"), 2, "model.dropout=0.1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One reference run per save world size, made when first asked for (dropout 0)."""
    runs: dict[int, Path] = {}

    def get(world_size: int) -> Path:
        if world_size not in runs:
            base = tmp_path_factory.mktemp(f"ref{world_size}")
            runs[world_size] = reference_run(base, world_size, "model.dropout=0")
        return runs[world_size]

    return get


# ------------------------------------------------------------ exact resumes --
@pytest.mark.slow
def test_same_world_size_resume_is_bit_identical_with_dropout(dropout_reference, tmp_path):
    proc = resume_from(dropout_reference, tmp_path, 2, "model.dropout=0.1")
    assert f"resume: step {RESUME_AT} from" in proc.stdout
    start, resumed = last_run(tmp_path / "logs")
    assert (start["step"], start["saved_world_size"], start["world_size"]) == (RESUME_AT, 2, 2)
    _, ref = last_run(dropout_reference / "logs")
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, event in resumed.items():
        # Dropout draws from the restored per-rank random streams: any other stream, data
        # position or learning rate shows up here as a difference.
        for key in ("loss", "grad_norm", "lr"):
            assert event[key] == ref[step][key], (step, key, event[key], ref[step][key])


# Every direction is a torchrun job with a reference run (--run-slow); 2 -> 1 runs on
# every tested torch release too.
@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [(4, 2), (2, 4), (1, 2),
                                            pytest.param(2, 1, marks=pytest.mark.torch_api)])
def test_resume_on_another_world_size_continues_the_run(reference, tmp_path, saved, resumed):
    proc = resume_from(reference(saved), tmp_path, resumed, "model.dropout=0")
    assert "random streams reseeded" in proc.stdout
    start, after = last_run(tmp_path / "logs")
    accum = project_module("loop.sampling").split_global_batch(16, 2, resumed).grad_accum_steps
    assert (start["step"], start["saved_world_size"]) == (RESUME_AT, saved)
    assert (start["world_size"], start["grad_accum_steps"]) == (resumed, accum)
    _, ref = last_run(reference(saved) / "logs")
    assert sorted(after) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, event in after.items():
        assert event["lr"] == ref[step]["lr"]          # the schedule is at the same step
        # Only the order of the sums changed (about 1e-7); a wrong sample or optimizer
        # state would move the loss by 1e-3 or more.
        assert abs(event["loss"] - ref[step]["loss"]) / ref[step]["loss"] < 1e-4, step


# ---------------------------------------------------------- resume --dry-run --
@pytest.mark.torch_api
def test_dry_run_on_an_empty_directory_prints_one_json_line(tmp_path):
    proc = run_module("resume", "--dry-run", "--nproc-per-node", "2", *BATCH,
                      f"checkpoint.dir={tmp_path / 'none'}")
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert json.loads(lines[0]) == {
        "step": 0, "checkpoint": None, "saved_world_size": None, "saved_grad_accum_steps": None,
        "world_size": 2, "grad_accum_steps": 4, "global_batch_size": 16}
    assert "starting fresh" in proc.stderr and "launch.agent" in proc.stderr
    assert not (tmp_path / "none").exists()     # a dry run creates nothing


# What resume needs before torchrun starts: torch for the task's model, not DCP nor
# torch._dynamo (seconds of CPU each, on the path of every job start).
LEAN = """
import sys
from {package}.launch.supervisor import main
code = main(["--dry-run", "checkpoint.dir={ckpt}", "recovery.warm_start=false"])
heavy = ("torch.distributed.checkpoint", "torch._dynamo", "torch.distributed.tensor")
print(code, *[name for name in heavy if name in sys.modules])
"""


def test_resume_imports_no_more_than_it_needs(tmp_path):
    proc = subprocess.run([sys.executable, "-c", LEAN.format(package=PACKAGE,
                                                             ckpt=tmp_path / "none")],
                          cwd=ROOT, env=suite_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.stdout.split("\n")[-2] == "0", proc.stdout + proc.stderr


def test_a_model_built_on_meta_has_the_shapes_of_a_real_one():
    contract = project_module("loop.task_contract")
    task, cfg = contract.load_task(), project_module("config").load_config(None, list(SMALL))
    real = task.build_model(cfg)
    meta = contract.build_on_meta(lambda: task.build_model(cfg))
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in real.state_dict().items()}
    assert all(v.is_meta for v in meta.state_dict().values())


def test_dry_run_after_a_run_shows_the_new_accumulation(dropout_reference, capsys):
    code, out, _ = dry_run(capsys, "--nproc-per-node", "1", *SMALL,
                           f"checkpoint.dir={dropout_reference / 'ckpt'}")
    assert code == 0
    name = project_module("checkpoint").step_name(STEPS)
    assert json.loads(out) == {
        "step": STEPS, "checkpoint": str(dropout_reference / "ckpt" / name),
        "saved_world_size": 2, "saved_grad_accum_steps": 4,
        "world_size": 1, "grad_accum_steps": 8, "global_batch_size": 16}


def test_damaged_newest_checkpoints_are_skipped(dropout_reference, tmp_path, capsys, caplog):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(dropout_reference / "ckpt", ckpt)
    step_name = project_module("checkpoint").step_name
    (ckpt / step_name(STEPS) / "commit.json").unlink()            # the save never committed
    with open(ckpt / step_name(STEPS - 2) / ".metadata", "r+b") as handle:
        handle.truncate(10)                                         # cut off mid-write
    code, out, _ = dry_run(capsys, "--nproc-per-node", "2", *SMALL, f"checkpoint.dir={ckpt}")
    assert code == 0
    assert json.loads(out)["step"] == STEPS - 4
    assert json.loads(out)["checkpoint"] == str(ckpt / step_name(STEPS - 4))
    assert "no commit.json" in caplog.text and ".metadata is 10 bytes" in caplog.text


def test_world_size_that_cannot_keep_the_global_batch_is_refused(tmp_path, capsys):
    code, out, err = dry_run(capsys, "--nproc-per-node", "3", *BATCH,
                             f"checkpoint.dir={tmp_path}")
    assert code == 2 and out == ""
    assert "cannot be split over 3 ranks" in err
    assert "the world size must be one of [1, 2, 4, 8]" in err


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0"], "positive integer or 'auto'"),
    (["--nnodes", "1:4"], "elastic ranges"),
])
def test_bad_arguments_are_refused(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        project_module("launch.supervisor").main(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_several_nodes_need_a_rendezvous_endpoint(tmp_path, capsys):
    code, _, err = dry_run(capsys, "--nnodes", "2", "--nproc-per-node", "1", *BATCH,
                           f"checkpoint.dir={tmp_path}")
    assert code == 2 and "--rdzv-endpoint" in err


@pytest.mark.parametrize("module", ["resume", "drill"])
def test_commands_answer_help(module, capsys):
    with pytest.raises(SystemExit) as info:
        project_module(module).main(["--help"])
    assert info.value.code == 0 and "usage" in capsys.readouterr().out


# ------------------------------------------ what resume does with torchrun --
FAKE_TORCHRUN = """
import os, signal, sys, time
from pathlib import Path
root, mode = Path(sys.argv[1]), sys.argv[2]
def commit_preemption_checkpoint():
    os.rename(root / "prepared", root / "ckpt" / "step_000000007")
def on_signal(signum, frame):
    (root / "received").write_text(signal.Signals(signum).name)
    if mode == "save-on-signal":
        commit_preemption_checkpoint()
    sys.exit(1)                         # what torchrun does after any signal
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(sig, on_signal)
if mode == "save-and-fail":
    commit_preemption_checkpoint()
    sys.exit(1)
if mode == "notice-no-new-save":       # newest checkpoint already at the stop step
    with open(root / "metrics.jsonl", "a") as log:
        log.write('{"event": "preemption", "source": "gcp-notice", "time": %r}\\n' % time.time())
    sys.exit(1)
if mode == "crash":
    sys.exit(3)
if mode == "finish":
    sys.exit(0)
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
(root / "ready").touch()
while True:
    time.sleep(0.01)
"""


def prepared_checkpoint(root: Path, step: int, reason: str) -> Path:
    """A committed checkpoint made by the layout's own commit, in ``root/prepared``."""
    layout = project_module("checkpoint.store.layout")
    storage = project_module("checkpoint.store.storage").LocalStorage(root / "staging")
    dcp.save({"w": torch.zeros(4)}, storage_writer=storage.writer(
        layout.staging_name(step, storage)), no_dist=True)
    committed = layout.commit(storage, step, {"world_size": 1, "reason": reason})
    shutil.move(committed.path, root / "prepared")
    return root / "prepared"


@pytest.mark.parametrize("mode, sig, old_preemption, expected", [
    ("save-on-signal", "SIGTERM", False, 75),   # preempted, final checkpoint committed
    ("wait", "SIGUSR1", False, 75),             # preempted, previous checkpoint stays
    ("wait", "SIGINT", False, 1),               # Ctrl-C is not a preemption
    ("save-and-fail", None, False, 75),         # a cloud notice: no signal to resume
    ("notice-no-new-save", None, False, 75),    # a notice, checkpoint already at that step
    ("crash", None, True, 3),                   # an old preemption checkpoint is not news
    ("finish", None, False, 0),
    ("killed", None, False, 128 + 9),
])
@pytest.mark.torch_api
def test_resume_forwards_signals_and_tells_preemption_from_failure(
        tmp_path, mode, sig, old_preemption, expected):
    resume = project_module("launch.supervisor")
    config = project_module("config")
    (tmp_path / "ckpt").mkdir()
    storage = project_module("checkpoint.store.storage").LocalStorage(tmp_path / "ckpt")
    if old_preemption:
        shutil.move(prepared_checkpoint(tmp_path, 3, "preemption"),
                    tmp_path / "ckpt" / "step_000000003")
    prepared_checkpoint(tmp_path, 7, "preemption")
    before = project_module("checkpoint").newest_complete_checkpoint(storage)
    if sig is not None:
        def scheduler() -> None:      # signals resume (this process) once the job runs
            deadline = time.monotonic() + 30
            while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.Signals[sig])
        threading.Thread(target=scheduler, daemon=True).start()
    command = [sys.executable, "-c", FAKE_TORCHRUN, str(tmp_path), mode]
    code = resume.supervise(command, storage, before, config.PreemptionConfig(),
                            tmp_path / "metrics.jsonl")
    assert code == expected
    if sig is not None:
        assert (tmp_path / "received").read_text() == sig


# ------------------------------------------------------------------- drill --
def drill_main(tmp_path: Path, capsys, *args: str) -> tuple[int, str]:
    code = project_module("tools.drill").main(["--config", CONFIG, "--out", str(tmp_path / "out"), *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--save-ranks", "2", "--resume-ranks", "1", "--steps", "10", "--interrupt-at", "10"],
     "--interrupt-at must be at least 1 and below --steps=10"),
    (["--save-ranks", "2", "--resume-ranks", "3", *BATCH], "cannot be split over 3 ranks"),
    (["--save-ranks", "2", "--resume-ranks", "1", "--interrupt-at", "12",
      "checkpoint.interval_steps=5"], "checkpoint.interval_steps=5 does not divide"),
    (["--save-ranks", "2", "--resume-ranks", "1", "train.max_steps=5"], "use --steps"),
    (["--save-ranks", "2", "--resume-ranks", "1", "model.d_model=30"], "model.d_model"),
])
def test_drill_refuses_bad_input_before_running_anything(tmp_path, capsys, args, message):
    code, err = drill_main(tmp_path, capsys, *args)
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()


def test_drill_refuses_zero_ranks(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        drill_main(tmp_path, capsys, "--save-ranks", "2", "--resume-ranks", "0")
    assert info.value.code == 2 and "positive integer" in capsys.readouterr().err


def test_drill_replaces_only_what_a_drill_wrote(tmp_path, capsys):
    drill = project_module("tools.drill")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = drill_main(tmp_path, capsys, "--save-ranks", "1", "--resume-ranks", "1")
    assert code == 2 and "not made by a drill" in err
    (out / "notes.txt").unlink()
    drill.prepare_out(out)                       # an empty directory becomes a drill's
    (out / "reference").mkdir()
    (out / "report.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    drill.prepare_out(out)                       # a re-run clears the drill's own outputs
    assert sorted(p.name for p in out.iterdir()) == [".drill", "notes.txt"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_kill_tree_reaches_processes_in_other_sessions():
    # Like torchrun's workers: the grandchild runs in a session of its own, out of reach
    # of a signal to the child's process group.
    spawn = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(60)'], start_new_session=True); "
             "print(p.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    assert project_module("tools.drill").kill_tree(child.pid) == 2
    assert child.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild)


def test_drill_verdict_needs_exact_equality_on_the_same_world_size():
    report = project_module("tools.drill_report")

    def run(losses):
        return {s: {"loss": v, "grad_norm": 1.0} for s, v in losses.items()}

    ref = run({5: 4.0, 6: 3.5})
    steps = [5, 6]
    same = report.compare(ref, run({5: 4.0, 6: 3.5}))
    assert report.judge(same, same_world=True, expected_steps=steps, problems=[])[0]
    one_ulp = report.compare(ref, run({5: 4.0, 6: 3.5000000000000004}))
    assert not report.judge(one_ulp, same_world=True, expected_steps=steps, problems=[])[0]
    assert report.judge(one_ulp, same_world=False, expected_steps=steps, problems=[])[0]
    off = report.compare(ref, run({5: 4.0, 6: 3.5 * (1 + 2e-4)}))
    assert not report.judge(off, same_world=False, expected_steps=steps, problems=[])[0]
    short = report.compare(ref, run({6: 3.5}))
    passed, why = report.judge(short, same_world=True, expected_steps=steps, problems=[])
    assert not passed and "expected 5-6" in why


def test_a_restart_that_found_the_run_finished_is_not_a_run(tmp_path):
    """A worker that aborts in torch's teardown after the last step (seen on torch 2.11)
    is restarted in place by torchrun; that start trains nothing and is left out, where a
    restart that trains on, or a start elsewhere, is a run."""
    def log(*events):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    def start(step):
        return {"event": "start", "step": step}

    def step(n):
        return {"event": "step", "step": n, "loss": 1.0, "grad_norm": 1.0}

    split = project_module("tools.drill_report").split_runs
    log(start(0), step(1), step(2), start(2))
    assert [(r.start["step"], sorted(r.steps)) for r in split(tmp_path)] == [(0, [1, 2])]
    log(start(0), step(1), step(2), start(1), step(2))
    assert [r.start["step"] for r in split(tmp_path)] == [0, 1]
    log(start(0), step(1), start(0))          # a restart with no checkpoint: from the start
    assert [r.start["step"] for r in split(tmp_path)] == [0, 0]


@pytest.mark.slow
def test_drill_two_ranks_to_one(tmp_path):
    out = tmp_path / "drill"
    proc = run_module("drill", "--save-ranks", "2", "--resume-ranks", "1", "--out", str(out),
                      timeout=600)
    assert "4/4" in proc.stdout and "PASSED" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True
    assert (report["save_world_size"], report["resume_world_size"]) == (2, 1)
    assert report["resumed_from_step"] == 12 < report["interrupted_at_step"]
    assert report["compared_steps"] == list(range(13, 25))
    assert report["max_rel_loss_diff"] < 1e-4
    assert report["before_kill_max_abs_loss_diff"] == 0       # this machine is deterministic
    assert report["processes_killed"] >= 3                     # torchrun and two workers
    assert report["resume_seconds"] > 0 and report["samples_per_s_after"] > 0
    assert report["resume_grad_accum_steps"] == 2 * report["saved_grad_accum_steps"]
    assert "PASSED" in (out / "report.md").read_text()
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")
