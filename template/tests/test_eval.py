"""Evaluation on held-out data: every sample once on any number of ranks, and a stop
during an evaluation that costs neither the grace period nor the evaluation point."""

from __future__ import annotations

import math
import os
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import (
    ROOT,
    finish,
    project_module,
    read_events,
    read_metrics,
    run_module,
    start,
    torchrun,
    wait_until,
)

SMALL = ["model.d_model=32", "model.n_layers=1", "data.corpus_chars=40000"]


@pytest.mark.torch_api
def test_the_evaluator_deals_every_sample_once_over_the_ranks():
    """No padding, no repeats: the ranks' shares partition the evaluated samples, for any
    world size, also with a max_batches limit."""
    evaluate = project_module("loop.evaluate")
    config = project_module("config").load_config(
        ROOT / "configs/train.yaml", [*SMALL, "eval.micro_batch_size=3", "eval.max_batches=5"])
    task = project_module("loop.task_contract").load_task()
    runtime = project_module("runtime.distributed").Runtime
    for world in (1, 2, 3, 4):
        seen = []
        for rank in range(world):
            evaluator = evaluate.Evaluator(config, task, runtime(rank, world, rank,
                                                                 torch.device("cpu"), "gloo"))
            seen += list(evaluator.my_samples())
        assert sorted(seen) == list(range(15)), world   # 5 batches of 3, dealt out


@pytest.mark.slow
def test_an_evaluation_is_the_same_on_one_two_and_four_ranks(tmp_path):
    """One checkpoint, evaluated by resuming it on 1, 2 and 4 ranks (a resume evaluates
    first when the saved run did not evaluate its step): the same eval loss to 1e-6."""
    trained = tmp_path / "trained"
    run_module("train", *SMALL, "train.max_steps=4", "checkpoint.interval_steps=4",
               "checkpoint.async_mode=sync", "eval.at_end=false",
               f"checkpoint.dir={trained / 'ckpt'}", f"log.dir={trained / 'logs'}")
    assert read_events(trained / "logs", "eval") == []
    losses = {}
    for ranks in (1, 2, 4):
        here = tmp_path / f"on{ranks}"
        shutil.copytree(trained / "ckpt", here / "ckpt")
        args = [*SMALL, "train.max_steps=4", "eval.every_steps=4", "checkpoint.async_mode=sync",
                "eval.micro_batch_size=5", f"checkpoint.dir={here / 'ckpt'}",
                f"log.dir={here / 'logs'}"]
        if ranks == 1:
            run_module("train", *args)
        else:
            torchrun(ranks, "train", *args)
        (event,) = read_events(here / "logs", "eval")
        assert event["step"] == 4 and event["eval_samples"] > 0
        assert event["eval_perplexity"] == pytest.approx(math.exp(event["eval_loss"]))
        losses[ranks] = event["eval_loss"]
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)
    assert losses[4] == pytest.approx(losses[1], rel=1e-6)


@pytest.mark.slow
def test_a_stop_during_an_evaluation_saves_in_time_and_the_resume_evaluates_first(tmp_path):
    """SIGTERM while an evaluation of many batches runs: it ends at the next batch, the
    final checkpoint commits within the grace period (exit 75), and the resumed run's
    first event after its start is the evaluation of that step."""
    args = [*SMALL, "data.corpus_chars=120000", "data.eval_fraction=0.6",
            "eval.micro_batch_size=1", "eval.every_steps=3",
            "model.d_model=64", "model.n_layers=2", "train.max_steps=6",
            "checkpoint.interval_steps=100", "preemption.grace_period_s=20",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"log.dir={tmp_path / 'logs'}"]
    log = tmp_path / "run.log"
    proc = start("train", *args, log_file=log)
    wait_until(lambda: "evaluating step 3" in log.read_text(), proc, "the evaluation", log_file=log)
    os.kill(proc.pid, signal.SIGTERM)
    assert finish(proc, 120) == 75, log.read_text()[-3000:]
    logs = tmp_path / "logs"
    assert read_events(logs, "eval") == []                # cut short: nothing reported
    (stop,) = read_events(logs, "preemption")
    assert stop["stop_step"] == 3 and stop["final_checkpoint_step"] == 3
    assert stop["signal_to_commit_s"] < stop["grace_period_s"]
    assert "evaluation of step 3 stopped by the stop request" in log.read_text()

    run_module("train", *args, "eval.every_steps=3")
    events = read_metrics(logs)
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    after = [e for e in events[starts[-1] + 1:] if e["event"] in ("eval", "step")]
    assert after[0]["event"] == "eval" and after[0]["step"] == 3
    assert [e["step"] for e in events if e["event"] == "eval"] == [3, 6]


# ----------------------------------------------------------- the best checkpoint --
def _committed_with_eval(tmp_path, layout, storage, step, loss, evaluated=True):
    work = layout.staging_name(step, storage)
    dcp.save({"w": torch.arange(50.0)}, storage_writer=storage.writer(work), no_dist=True)
    evaluation = {"eval_loss": loss}
    layout.commit(storage, step, {"world_size": 1, "eval": evaluation,
                                  "last_eval_step": step if evaluated else step - 1})


def test_keep_best_keeps_the_best_besides_the_newest_through_retirements(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    best = layout.BestRule(keep=2, metric="eval_loss", mode="min")
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 0.5), (5, 4.0), (6, 9.0)):
        # Step 4's figures belong to an earlier evaluation: it does not rank.
        _committed_with_eval(tmp_path, layout, storage, step, loss, evaluated=step != 4)
        layout.retire_old(storage, keep_last=1, up_to=step, best=best)
    assert [c.step for c in layout.list_committed(storage)] == [2, 3, 6]
    assert [c.step for c in best.best(layout.list_committed(storage))] == [2, 3]
    highest = layout.BestRule(keep=1, metric="eval_loss", mode="max")
    assert [c.step for c in highest.best(layout.list_committed(storage))] == [6]
    assert [c.step for c in layout.BestRule().best(layout.list_committed(storage))] == []


@pytest.mark.slow
def test_the_best_checkpoint_survives_retirement_and_a_restart_and_exports(tmp_path):
    """keep_best=1 by the highest eval loss (the first evaluation, as the loss falls):
    step 2 stays while keep_last=1 retires the others, across a restart; verify names it
    and export --best takes it."""
    args = [*SMALL, "eval.every_steps=2", "checkpoint.interval_steps=2",
            "checkpoint.keep_last=1", "checkpoint.keep_best=1", "checkpoint.best_mode=max",
            "checkpoint.async_mode=sync", f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"log.dir={tmp_path / 'logs'}"]
    run_module("train", *args, "train.max_steps=6")
    run_module("train", *args, "train.max_steps=10")      # a restart: resumes from step 6
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert names == ["step_000000002", "step_000000010"]
    evals = {e["step"]: e["eval_loss"] for e in read_events(tmp_path / "logs", "eval")}
    assert sorted(evals) == [2, 4, 6, 8, 10] and max(evals, key=evals.get) == 2
    verify = run_module("verify", *args)
    assert "kept as best (checkpoint.keep_best=1, eval_loss, max): step 2" in verify.stdout
    out = tmp_path / "best"
    export = run_module("export", "--best", "--format", "torch", "--out", str(out), *args)
    assert "step_000000002" in export.stdout
