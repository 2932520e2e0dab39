"""The kill loop: the whole job SIGKILLed at random moments, over and over.

Process-mode saves every 2 steps on a model whose saves take a few tenths of a second,
and, when the project has the memory tier (the copier answer memory_tier), a memory copy
every step (the node lives, so its copies survive each kill and a start may load one), so kills land before, during and after saves, while the
checkpoint process starts, while a commit or a memory copy is written. After every kill:
nothing torn (every committed checkpoint and every committed memory copy verifies),
nothing lost (the newest committed step never goes back). After the kills, one last run
finishes the schedule: every step any run logged, and the final losses, are bit-identical
to an uninterrupted run of the same configuration (the same train.max_steps: the learning
rate's cosine depends on it, so a shorter reference would differ after the warm-up).
"""

import os
import random
import signal
import time

import pytest

from conftest import project_module, read_events, read_metrics, run_module, start, wait_until

KILLS = int(os.environ.get("KILL_LOOP_KILLS", "100"))
# Well past what the kills reach: each kill waits for at most 6 more logged steps (and
# half a second), a quarter of them for none, and every resume redoes a step or two. 30
# more keep a few kills from reaching the end, which ends the loop early (4 kills, the
# template's own CI, reached step 20 where 3 a kill gave 12).
MAX_STEPS = int(os.environ.get("KILL_LOOP_STEPS", str(3 * KILLS + 30)))
MODEL = ["model.d_model=192", "model.n_layers=3", "model.dropout=0.1", "log.every_steps=1000",
         "train.micro_batch_size=16", "checkpoint.interval_steps=2", "checkpoint.keep_last=3",
         f"train.max_steps={MAX_STEPS}", "checkpoint.async_mode=process"]
PARTS = project_module("config.parts")
MEMORY = PARTS.rendered(PARTS.MEMORY_TIER)
if MEMORY:
    MODEL.append("checkpoint.memory_interval_steps=1")


def committed(storage) -> list[int]:
    return [c.step for c in project_module("checkpoint").list_committed(storage, warn=False)]


# About 11 minutes on a quiet 2-core machine (KILL_LOOP_KILLS=10 for a quick look).
@pytest.mark.slow
def test_a_hundred_sigkills_lose_nothing_and_tear_nothing(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    args = [*MODEL, f"checkpoint.dir={ckpt}", f"log.dir={logs}"]
    storage = project_module("checkpoint").open_storage(str(ckpt))
    layout = project_module("checkpoint.store.layout")
    memory = project_module("checkpoint.memory.copies") if MEMORY else None
    reading = project_module("checkpoint.memory.reading") if MEMORY else None
    copies = memory.run_folder("/dev/shm", str(ckpt)) if MEMORY else None
    torn_copies = 0
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
        for copy in memory.inventory(copies, 1).values() if MEMORY else ():
            try:
                reading.Opened(copy).close()
            except (OSError, memory.MemoryCopyError):
                torn_copies += 1
        if steps and steps[-1] < newest:
            lost += 1
        newest = max(newest, steps[-1] if steps else 0)
    # The kills are over: one last run, left alone, finishes the schedule.
    finish_time = time.time()
    finish = run_module("train", *args, timeout=1800)
    assert f"finished at step {MAX_STEPS}" in finish.stdout + finish.stderr
    events = read_metrics(logs)
    from_memory = sum(e["event"] == "start" and e.get("resumed_tier") == "memory" for e in events)
    save_times = [e["write_s"] for e in events if e["event"] == "save"]
    reached = max(e["step"] for e in events if e["event"] == "step" and e["time"] < finish_time)
    print(f"\nkill loop: {KILLS} kills, {torn} torn, {lost} lost, newest committed step "
          f"{newest}, highest step trained {reached}, {len(save_times)} saves committed "
          f"(write time median {sorted(save_times)[len(save_times) // 2] if save_times else 0:.2f}"
          f" s), {from_memory} starts from a memory copy, {torn_copies} torn memory copies")
    assert torn == 0 and lost == 0 and torn_copies == 0
    if MEMORY:
        assert from_memory >= KILLS // 4   # the memory tier took part
        assert not copies.exists()   # the finished run freed them
    assert newest >= KILLS // 2 and len(save_times) >= KILLS // 4   # it saved and resumed

    # The same schedule, uninterrupted and never saved: every step any run logged matches.
    ref_logs = tmp_path / "ref-logs"
    run_module("train", *MODEL, f"checkpoint.dir={tmp_path / 'ref'}", f"log.dir={ref_logs}",
               f"checkpoint.interval_steps={10 * MAX_STEPS}", timeout=1800)
    reference = {e["step"]: e["loss"] for e in read_metrics(ref_logs) if e["event"] == "step"}
    assert len(reference) == MAX_STEPS
    logged = [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    different = [(step, loss, reference[step]) for step, loss in logged if loss != reference[step]]
    assert not different, f"{len(different)} of {len(logged)} logged steps differ: {different[:5]}"
    assert max(step for step, _ in logged) == MAX_STEPS
