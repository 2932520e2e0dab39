"""The goodput ledger of a real run: a worker killed with SIGKILL (torchrun restarts the
workers in place), then a SIGUSR1 preemption through ``resume``, then resumed to the end.
The parts add up to the wall time, both interruptions are listed by kind with the steps
they lost, and with ``log.dir`` gone the history alone still tells them."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    PACKAGE,
    ROOT,
    cmdline,
    descendants,
    rank_of,
    read_events,
    run_module,
    suite_env,
    wait_until,
)

pytestmark = pytest.mark.slow

RUN = ["model.d_model=32", "model.n_layers=1", "train.max_steps=120",
       "checkpoint.interval_steps=10", "eval.at_end=false"]


def resume(dirs: dict, log: Path) -> subprocess.Popen:
    with open(log, "w", encoding="utf-8") as out:
        return subprocess.Popen(
            [sys.executable, "-m", f"{PACKAGE}.resume", "--nproc-per-node", "2", *RUN,
             f"checkpoint.dir={dirs['ckpt']}", f"log.dir={dirs['logs']}"], cwd=ROOT,
            env=suite_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def steps_after(logs: Path, step: int) -> bool:
    return any(e["step"] > step for e in read_events(logs, "step"))


def test_a_killed_worker_and_a_preemption_are_in_the_ledger(run_dirs, tmp_path):
    logs = Path(run_dirs["logs"])
    log = tmp_path / "job.log"
    proc = resume(run_dirs, log)
    wait_until(lambda: steps_after(logs, 25), proc, "step 26", log_file=log)
    worker = next(pid for pid in descendants(proc.pid)
                  if f"{PACKAGE}.train".encode() in cmdline(pid) and rank_of(pid) == "1")
    os.kill(worker, signal.SIGKILL)            # torchrun restarts both workers in place
    wait_until(lambda: len(read_events(logs, "start")) >= 2 and steps_after(logs, 45), proc,
               "the restarted workers past step 45", log_file=log)
    proc.send_signal(signal.SIGUSR1)           # a preemption with notice
    assert proc.wait(timeout=120) == 75, log.read_text()[-3000:]
    time.sleep(1.0)                            # a queue between the jobs
    finished = run_module("resume", "--nproc-per-node", "2", *RUN,
                          f"checkpoint.dir={run_dirs['ckpt']}", f"log.dir={logs}")
    assert "finished at step 120" in finished.stdout

    ledger = json.loads(run_module("goodput", "--json", *RUN,
                                   f"checkpoint.dir={run_dirs['ckpt']}",
                                   f"log.dir={logs}").stdout)
    parts = ledger["parts_s"]
    assert set(parts) == {"productive", "rework", "saving", "eval", "restart", "unaccounted"}
    assert abs(sum(parts.values()) - ledger["wall_s"]) <= 0.01 * ledger["wall_s"]
    assert abs(parts["unaccounted"]) <= 0.1 * ledger["wall_s"], parts
    assert parts["productive"] > 0 and parts["restart"] > 0
    kinds = [i["kind"] for i in ledger["interruptions"]]
    assert kinds == ["rank_lost", "preempted_notice"], ledger["interruptions"]
    lost, preempted = ledger["interruptions"]
    assert lost["steps_lost"] > 0 and lost["step"] > 25        # since the step-20 save
    assert preempted["steps_lost"] == 0                        # saved at the stop
    assert parts["rework"] > 0                                 # the killed steps again
    assert ledger["mtbi"]["count"] == 2 and ledger["mtbi"]["exposure_s"] > 0
    assert ledger["crash_share"] == {"estimate": 0.5, "count": 1}
    assert 0 < ledger["planned_badput_percent"] < 100

    plot = tmp_path / "timeline.png"
    run_module("goodput", *RUN, f"checkpoint.dir={run_dirs['ckpt']}", f"log.dir={logs}",
               "--plot", str(plot))
    assert plot.stat().st_size > 10_000

    shutil.rmtree(logs)                        # a lost disk: the history alone
    coarse = json.loads(run_module("goodput", "--json", *RUN,
                                   f"checkpoint.dir={run_dirs['ckpt']}",
                                   f"log.dir={logs}").stdout)
    # each start wrote how the one before it ended into the history when it began
    assert coarse["coarse"] and [i["kind"] for i in coarse["interruptions"]] == kinds
    assert abs(sum(coarse["parts_s"].values()) - coarse["wall_s"]) <= 0.01 * coarse["wall_s"]
