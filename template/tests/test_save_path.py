"""Saves stay off the training path, a save given up is never committed, and the save
plan comes from the cache.

A deliberately slow storage (``slow_storage.SlowWriter`` sleeps before it writes) must
not slow ``save()`` down, nor the training steps while the save is written: if saves
were written on the training path (e.g. synchronously), these tests fail. The probe runs
in a process of its own, with DCP's checkpoint process in ``process`` mode.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import ROOT, project_module, suite_env

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api

DELAY_S = 2.0   # how long the slow storage sleeps before writing a save


@pytest.fixture(scope="module", params=["thread", "process"])
def probe(request) -> dict:
    """One probe run per mode: a save through the slow storage, then a training loop."""
    env = suite_env()
    tests = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = tests + os.pathsep + env["PYTHONPATH"]   # for the checkpoint process
    proc = subprocess.run([sys.executable, "-c", "import slow_storage; slow_storage.main()",
                           request.param, str(DELAY_S)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_slow_storage_does_not_slow_the_save_call(probe):
    """save() returns, and the state is staged, in a small fraction of the write time;
    the checkpoint is committed later, once the slow write is done."""
    save = probe["save"]
    assert save["blocking_s"] < 0.2 * DELAY_S, save
    assert not save["committed_at_return"], save
    assert save["commit_latency_s"] >= DELAY_S, save
    assert save["newest_step"] == 1


def test_training_steps_are_unaffected_while_a_save_is_in_flight(probe):
    """The step that starts the save and the steps trained while it is written take what
    the steps without a save take; the save commits meanwhile."""
    steps = probe["train"]["steps"]
    clean = [s for s, kind in steps if kind == "clean"]
    started = [s for s, kind in steps if kind == "save"]
    in_flight = [s for s, kind in steps if kind == "in_flight"]
    assert len(started) == 1 and len(clean) >= 5, steps
    typical = statistics.median(clean)
    assert started[0] < typical + 0.2 * DELAY_S, steps
    assert len(in_flight) >= 3, steps            # the save really was written meanwhile
    # The slow storage sleeps DELAY_S in the write: a write on the training path would put
    # all of it into one step. Every in-flight step but the largest stays near the clean
    # steps; the largest may also carry a hiccup of a loaded machine (a torch leg runs 3
    # suites on 2 cores: one step of 0.84 s seen), never the write.
    ordered = sorted(in_flight)
    assert ordered[-1] < typical + 0.5 * DELAY_S, steps
    assert ordered[-2] < typical + 0.2 * DELAY_S, steps
    # Against the clean steps' upper quartile: their spread is this machine's load,
    # which moved between the two windows (a torch leg runs 3 suites on 2 cores).
    slow_clean = statistics.quantiles(clean, n=4)[2]
    assert statistics.median(in_flight) < 1.5 * slow_clean + 0.05, steps
    assert probe["train"]["committed_step"] == 1000
    assert probe["train"]["commit_latency_s"] >= DELAY_S


def test_a_background_save_given_up_is_never_committed_when_it_finishes(tmp_path):
    """A save abandoned while the slow storage still writes it (a stop that ran out of
    grace) must not be committed by the upload thread once the write is done."""
    import slow_storage

    pipeline_mod = project_module("checkpoint.save.pipeline")
    storage = slow_storage.slow_storage(tmp_path / "ckpt", 0.5)
    pipeline = pipeline_mod.SavePipeline(storage, mode="thread", keep_last=2,
                                            is_coordinator=True, device=torch.device("cpu"))
    pipeline.prepare()
    pipeline.save(3, {"w": torch.ones(16)}, "interval", {"world_size": 1})
    pipeline.wait_staged()
    assert pipeline.abandon("test") == 3
    time.sleep(1.5)   # the write finishes meanwhile
    assert pipeline.newest() is None and pipeline.last_committed is None
    assert not (tmp_path / "ckpt" / "step_000000003.tmp" / "commit.json").exists()


# ---------------------------------------------------------------- plan cache --
@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_the_save_plan_comes_from_the_cache_even_between_other_saves(tmp_path, mode):
    """Saves of the same state after the first reuse the cached plan, counted by the
    pipeline's own planner in the process that plans (this one in sync and thread mode).
    A differently shaped save in between (the checkpoint process's start-up save has a
    planner class of its own, as an export must) does not evict it."""
    pipeline_mod = project_module("checkpoint.save.pipeline")
    storage = project_module("checkpoint.store.storage").LocalStorage(tmp_path / "ckpt")
    background = project_module("checkpoint.save.background")
    pipeline = pipeline_mod.SavePipeline(storage, mode=mode, keep_last=2,
                                            is_coordinator=True, device=torch.device("cpu"))
    pipeline.prepare()
    progress = {"step": 0}
    state = {"w": torch.randn(64, 8), "b": torch.zeros(8), "progress": progress}
    planner = project_module("checkpoint.save.dcp_planner").TrainingStatePlanner
    hits = []
    for step in range(1, 5):
        state["progress"]["step"] = step
        state["w"].add_(1.0)
        before = planner.cache_hits
        result = pipeline.save(step, state, "interval", {"world_size": 1})   # sync: committed
        assert (result or pipeline.wait()) is not None, pipeline.last_error
        hits.append(planner.cache_hits - before)
        other = {"another": torch.ones(3), "shape": torch.ones(5, 2)}
        dcp.save(other, storage_writer=dcp.FileSystemWriter(tmp_path / f"other{step}"),
                 planner=background._StartPlanner())
    pipeline.close()
    assert hits[1:] == [1, 1, 1], hits


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def test_the_state_a_save_sees_is_always_a_fresh_walks():
    """The names ``get_state_dict`` finds are reused between saves, yet every save sees
    exactly what a fresh ``get_state_dict`` gives: new values, the scheduler's new
    learning rate, and new tensors after a load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state_mod = project_module("checkpoint.state")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    adapter = state_mod.ModelAndOptimizer(model, optimizer)

    def step() -> None:
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    def check() -> None:
        fresh_model, fresh_optim = get_state_dict(model, optimizer)
        assert _same(adapter.state_dict(), {"model": fresh_model, "optim": fresh_optim})

    step()
    for _ in range(4):
        check()
        step()
    assert adapter.reused == 3
    loaded = copy.deepcopy(optimizer.state_dict())     # a load: new tensors, new values
    for per_param in loaded["state"].values():
        per_param["exp_avg"] += 1.0
    optimizer.load_state_dict(loaded)
    check()                                              # walked again, not reused
    assert adapter.reused == 3
    step()
    check()
    assert adapter.reused == 4
