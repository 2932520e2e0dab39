"""Preemption: signals and cloud notices stop every rank at one step, finish the save in
flight, and commit a final checkpoint inside the grace period.

Jobs are started the way a scheduler starts them (torchrun from the project's own
launch builder, in a session of its own) and stopped the way it stops them: a signal to
torchrun alone, which passes it on to each worker's process group - DCP's background
checkpoint process included.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from conftest import (
    ROOT,
    children,
    finish,
    overrides_for,
    project_module,
    read_events,
    read_metrics,
    run_module,
    start,
    wait_until,
)

GRACE = 30.0
# A stop that never comes must fail the test, not pass it: far more steps than any test
# lets run (a few tenths of a second each on a laptop CPU).
MAX_STEPS = 300
SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=10"]
# "preempted, run again" as the generated config sets it (EX_TEMPFAIL by default).
EXIT_PREEMPTED = project_module("config").load_config(ROOT / "configs/train.yaml").preemption.exit_code
NOTICE_SOURCE = {"aws": "aws-notice", "gcp": "gcp-notice", "azure": "azure-notice"}


overrides = overrides_for(*SMALL, f"train.max_steps={MAX_STEPS}", "checkpoint.interval_steps=4",
                          "checkpoint.async_mode=process", f"preemption.grace_period_s={GRACE:g}")


@pytest.fixture
def preemption():
    return project_module("preemption.watch")


def storage_of(dirs: dict[str, str]):
    return project_module("checkpoint").open_storage(dirs["ckpt"])


def committed_steps(dirs: dict[str, str]) -> list[int]:
    return [c.step for c in project_module("checkpoint").list_committed(storage_of(dirs))]


def save_being_written(ckpt: Path) -> Path | None:
    """A save DCP is still writing: its directory exists, .metadata (written last) not yet."""
    for work in sorted(ckpt.glob("step_*.tmp")) if ckpt.is_dir() else []:
        if not (work / ".metadata").exists():
            return work
    return None


def step_of(path: Path) -> int:
    return int(re.match(r"step_(\d+)", path.name).group(1))


def assert_stopped_with_final_checkpoint(dirs: dict[str, str], log_file: Path, source: str,
                                         world_size: int, check_resume: bool = False) -> dict:
    """One preemption event; every rank stopped at the last step trained; the newest
    complete checkpoint is a ``preemption`` one at that step, committed inside the grace
    period; and (``check_resume``) the restart command picks it. Returns the event."""
    log = log_file.read_text(errors="replace")
    events = read_metrics(Path(dirs["logs"]))
    stops = [e for e in events if e["event"] == "preemption"]
    assert len(stops) == 1, log[-6000:]
    stop = stops[0]
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert stop["source"] == source
    assert stop["stop_step"] == steps[-1] == max(steps)
    assert stop["rank_stop_steps"] == [stop["stop_step"]] * world_size
    assert stop["final_checkpoint_step"] == stop["stop_step"], stop
    assert stop["final_save_skipped_reason"] is None
    assert 0 < stop["signal_to_commit_s"] < GRACE, stop
    assert 0 < stop["grace_left_s"] <= GRACE - stop["signal_to_commit_s"] + 1e-6, stop
    assert stop["resume_step"] == stop["stop_step"]

    newest = project_module("checkpoint").newest_complete_checkpoint(storage_of(dirs))
    assert newest is not None and newest.step == stop["stop_step"], log[-6000:]
    assert newest.record["reason"] == "preemption" and newest.world_size == world_size
    assert {f"__{rank}_0.distcp" for rank in range(world_size)} <= set(newest.record["files"])
    assert f"exit status {EXIT_PREEMPTED}: preempted" in log  # what rank 0's worker returned

    if check_resume:  # --dry-run prints its plan as one JSON line on stdout
        proc = run_module("resume", "--dry-run", *overrides(dirs), timeout=120)
        plan = json.loads(proc.stdout.strip().splitlines()[-1])
        assert plan["step"] == stop["stop_step"] and plan["checkpoint"] == newest.path
    return stop


# --------------------------------------------------------------- in-process --

def test_handler_only_records_the_first_request_and_counts_the_rest(preemption):
    watch = preemption.PreemptionWatch(["SIGUSR1"])
    assert signal.SIGINT in watch.signals  # Ctrl-C stops the same way
    before = signal.getsignal(signal.SIGUSR1)
    watch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        first = watch.requested
        watch.request("aws-notice", "terminate at noon")
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert first.source == "SIGUSR1" and watch.requested == first
    assert watch.count == 3


def test_bad_notice_settings_are_refused_naming_the_key():
    config = project_module("config")
    for override, key in [("preemption.notice_source=ibm", "notice_source"),
                          ("preemption.metadata_url=169.254.169.254", "preemption.metadata_url"),
                          ("preemption.poll_interval_s=0", "preemption.poll_interval_s")]:
        with pytest.raises(config.ConfigError, match=re.escape(key)):
            config.load_config(ROOT / "configs/train.yaml", [override])


@pytest.mark.torch_api
def test_torchrun_command_forwards_preemption_signals_and_outwaits_the_grace():
    config = project_module("config").load_config(
        ROOT / "configs/train.yaml", ["preemption.grace_period_s=45.5",
                                      "preemption.signals=[SIGTERM,SIGUSR2]"])
    cmd = project_module("launch.torchrun").torchrun_command("train", [], config.preemption,
                                                    nproc_per_node=2,
                                                    max_restarts=config.recovery.max_restarts)
    handled = next(a for a in cmd if a.startswith("--signals-to-handle=")).split("=")[1]
    assert {"SIGTERM", "SIGINT", "SIGUSR2"} <= set(handled.split(","))
    timeout = int(next(a for a in cmd if a.startswith("--shutdown-timeout=")).split("=")[1])
    assert timeout > 45.5


@pytest.mark.torch_api
def test_drain_gives_up_at_the_deadline_and_never_commits_what_it_gave_up(tmp_path):
    pipeline_module = project_module("checkpoint.save.pipeline")
    storage = project_module("checkpoint").open_storage(str(tmp_path / "ckpt"))
    pipeline = pipeline_module.SavePipeline(storage, mode="sync", keep_last=2,
                                               is_coordinator=True, device=torch.device("cpu"))
    pipeline.prepare()
    never: Future = Future()  # a background write that does not finish in time
    pipeline._inflight = project_module("checkpoint.save.commit").InFlight(
        7, "interval", {}, time.perf_counter(), 0.0, never, None)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="step 7"):
        pipeline.wait(timeout=0.2)
    assert 0.2 <= time.monotonic() - began < 5
    assert pipeline.in_flight_step == 7  # still in flight until given up
    assert pipeline.abandon() == 7 and pipeline.in_flight_step is None
    never.set_result(None)  # finishing late changes nothing: it is no longer tracked
    assert pipeline.wait() is None and pipeline.last_committed is None
    assert project_module("checkpoint").list_committed(storage) == []


# ------------------------------------------------------------ training jobs --

@pytest.mark.slow
def test_sigterm_to_torchrun_while_a_process_save_is_in_flight(run_dirs, tmp_path):
    log_file = tmp_path / "job.log"
    proc = start("train", *overrides(run_dirs), nproc=2, log_file=log_file)
    writing = wait_until(lambda: save_being_written(Path(run_dirs["ckpt"])), proc,
                         "a save being written", log_file=log_file)
    proc.send_signal(signal.SIGTERM)
    assert finish(proc, GRACE + 90) != 0  # torchrun exits 1 once signalled, whatever happened
    stop = assert_stopped_with_final_checkpoint(run_dirs, log_file, "SIGTERM", world_size=2,
                                                check_resume=True)
    in_flight = step_of(writing)
    assert in_flight < stop["stop_step"]
    # torchrun signalled each worker's process group, DCP's checkpoint process with it:
    # that process takes a stop only from its worker, so the save it was writing is
    # finished and committed (the drain) before the final save at the stop step.
    output = log_file.read_text()
    assert in_flight in committed_steps(run_dirs), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig, seed, again", [("SIGTERM", 1, True), ("SIGUSR1", 2, False)],
                         ids=["SIGTERM-twice", "SIGUSR1"])
def test_signal_to_torchrun_at_a_seeded_moment(run_dirs, tmp_path, sig, seed, again):
    log_file = tmp_path / "job.log"
    logs = Path(run_dirs["logs"])
    proc = start("train", *overrides(run_dirs), nproc=2, log_file=log_file)
    wait_until(lambda: read_events(logs, "step"), proc, "the first step", log_file=log_file)
    workers = worker_pids(proc.pid)
    time.sleep(random.Random(seed).uniform(0.0, 4.0))  # before, during or after a save
    proc.send_signal(getattr(signal, sig))
    if again:
        wait_until(lambda: "stop requested" in log_file.read_text(), proc, "the stop to begin",
                   log_file=log_file)
        # A scheduler that signals every process of the job (Slurm's scancel does) hits
        # the workers again while they save; torchrun gets a second one too.
        delivered = 0
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
                delivered += 1
            except ProcessLookupError:  # that worker had already finished its stop
                pass
        proc.send_signal(signal.SIGTERM)
    assert finish(proc, GRACE + 90) != 0  # torchrun exits 1 once signalled
    stop = assert_stopped_with_final_checkpoint(run_dirs, log_file, sig, world_size=2,
                                                check_resume=True)
    if again and delivered == len(workers):
        assert stop["signals_received"] >= 2  # counted, and nothing else changed
    leftovers = list(Path(run_dirs["ckpt"]).glob(f"step_{stop['stop_step']:09d}.*"))
    assert leftovers == []  # the final save was not left half-written beside its commit


def worker_pids(parent: int) -> list[int]:
    """The direct children of ``parent`` (torchrun's workers), from /proc."""
    workers = children(parent)
    assert workers, f"no workers under pid {parent}"
    return workers


@pytest.mark.torch_api
def test_single_process_exits_preempted_on_sigterm_after_finishing_the_save_in_flight(
        run_dirs, tmp_path):
    log_file = tmp_path / "job.log"
    proc = start("train", *overrides(run_dirs), log_file=log_file)
    writing = wait_until(lambda: save_being_written(Path(run_dirs["ckpt"])), proc,
                         "a save being written", log_file=log_file)
    os.kill(proc.pid, signal.SIGTERM)  # the worker alone: its checkpoint process lives on
    assert finish(proc, GRACE + 90) == EXIT_PREEMPTED
    stop = assert_stopped_with_final_checkpoint(run_dirs, log_file, "SIGTERM", world_size=1)
    assert step_of(writing) in committed_steps(run_dirs)  # finished and committed, not lost
    # The save drained while stopping is that one, or one started after it.
    assert stop["drained_step"] is None or stop["drained_step"] >= step_of(writing)


@pytest.mark.torch_api
@pytest.mark.parametrize("mode, reasons", [
    ("sync", ("grace left",)),  # nothing in flight: the measured save time does not fit
    ("process", ("grace left", "used up the grace period")),  # or the drain gives up
])
def test_grace_too_short_for_a_save_keeps_the_newest_committed_checkpoint(
        run_dirs, tmp_path, mode, reasons):
    log_file = tmp_path / "job.log"
    logs = Path(run_dirs["logs"])
    # Reaching the step boundary alone takes longer than this grace period: whatever the
    # measured save time, it cannot fit.
    args = [a for a in overrides(run_dirs) if not a.startswith(("preemption.grace_period_s=",
                                                               "checkpoint.async_mode="))]
    proc = start("train", *args, "preemption.grace_period_s=0.01",
                 f"checkpoint.async_mode={mode}", log_file=log_file)
    wait_until(lambda: read_events(logs, "save"), proc, "the first save", log_file=log_file)
    os.kill(proc.pid, signal.SIGTERM)
    assert finish(proc, 120) == EXIT_PREEMPTED
    log = log_file.read_text()
    stop = read_events(logs, "preemption")[0]
    assert stop["final_checkpoint_step"] is None, stop
    assert any(reason in stop["final_save_skipped_reason"] for reason in reasons), stop
    assert f"no final checkpoint ({stop['final_save_skipped_reason']})" in log
    newest = project_module("checkpoint").newest_complete_checkpoint(storage_of(run_dirs))
    assert newest.record["reason"] == "interval" and newest.step < stop["stop_step"]
    assert stop["resume_step"] == newest.step
