"""The kill loop: the whole job SIGKILLed at random moments, over and over.

Process-mode saves every 2 steps on a model whose saves take a few tenths of a second,
so kills land before, during and after saves, while the checkpoint process starts, while
a commit is written. After every kill: nothing torn (every committed checkpoint verifies),
nothing lost (the newest committed step never goes back). At the end: every step any run
logged is bit-identical to an uninterrupted run.
"""

import os
import random
import signal
import time

import pytest

from conftest import project_module, read_events, read_metrics, run_module, start, wait_until

KILLS = int(os.environ.get("KILL_LOOP_KILLS", "100"))
MODEL = ["model.d_model=192", "model.n_layers=3", "model.dropout=0.1", "log.every_steps=1000",
         "checkpoint.interval_steps=2", "checkpoint.keep_last=3", "train.max_steps=100000",
         "checkpoint.async_mode=process"]


def committed(storage) -> list[int]:
    return [c.step for c in project_module("checkpoint").list_committed(storage, warn=False)]


# Opt-in (KILL_LOOP=1): about 10 minutes on a quiet 2-core machine, and the last run (100
# kills, 0 torn, 0 lost) found losses after one resume differing from the uninterrupted run
# by about 1e-7 from step 23 on: an open finding, not yet explained, so not a CI gate.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KILL_LOOP") != "1", reason="opt-in: KILL_LOOP=1")
def test_a_hundred_sigkills_lose_nothing_and_tear_nothing(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    args = [*MODEL, f"checkpoint.dir={ckpt}", f"log.dir={logs}"]
    storage = project_module("checkpoint").open_storage(str(ckpt))
    layout = project_module("checkpoint.layout")
    rng = random.Random(20261130)
    newest, torn, lost, save_times = 0, 0, 0, []
    for kill in range(KILLS):
        steps_before = len(read_events(logs, "step"))
        proc = start("train", *args, log_file=tmp_path / f"run{kill % 2}.log")
        if rng.random() < 0.25:             # during start-up: building, resuming, warming up
            time.sleep(rng.uniform(0.0, 3.0))
        else:                               # during training, saving, committing
            target = steps_before + rng.randint(1, 6)
            wait_until(lambda n=target: len(read_events(logs, "step")) >= n, proc,
                       "training", timeout=300, log_file=tmp_path / f"run{kill % 2}.log")
            time.sleep(rng.uniform(0.0, 0.5))
        os.killpg(proc.pid, signal.SIGKILL)    # the whole job: trainer and checkpoint process
        proc.wait()
        steps = committed(storage)
        for name in layout.checkpoint_names(storage):
            verdict = layout.verify_checkpoint(storage, name)
            torn += verdict.failed
        if steps and steps[-1] < newest:
            lost += 1
        newest = max(newest, steps[-1] if steps else 0)
    events = read_metrics(logs)
    save_times = [e["write_s"] for e in events if e["event"] == "save"]
    reached = max(e["step"] for e in events if e["event"] == "step")
    print(f"\nkill loop: {KILLS} kills, {torn} torn, {lost} lost, newest committed step "
          f"{newest}, highest step trained {reached}, {len(save_times)} saves committed "
          f"(write time median {sorted(save_times)[len(save_times) // 2] if save_times else 0:.2f}"
          " s)")
    assert torn == 0 and lost == 0
    assert newest >= KILLS // 2 and len(save_times) >= KILLS // 4   # it saved and resumed

    # The same steps, uninterrupted: every step any interrupted run logged matches it.
    ref_logs = tmp_path / "ref-logs"
    run_module("train", *MODEL, f"train.max_steps={reached}", f"checkpoint.dir={tmp_path / 'ref'}",
               f"log.dir={ref_logs}", "checkpoint.interval_steps=100000", timeout=1800)
    reference = {e["step"]: e["loss"] for e in read_metrics(ref_logs) if e["event"] == "step"}
    logged = [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    different = [(step, loss, reference[step]) for step, loss in logged if loss != reference[step]]
    assert not different, different[:5]
