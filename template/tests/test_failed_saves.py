"""Failing saves end training only once their budget is spent in count AND in time.

checkpoint.max_failed_saves failures in a row and checkpoint.max_failed_saves_s without
a commit, on a fake clock: the rule itself, the save policy that applies it, the
configuration that feeds it, and two ranks whose clocks disagree deciding alike.
"""

from __future__ import annotations

import io
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from test_decisions import FakeBoundary, FakePipeline, FakeTraining, make_checkpointer

from conftest import ROOT, project_module

FailedSaves = project_module("checkpoint.failed_saves").FailedSaves
policy_mod = project_module("checkpoint.policy")
checkpointer_mod = project_module("checkpoint.checkpointer")
metrics_mod = project_module("runtime.metrics")
Progress = project_module("checkpoint.state").Progress


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------- the rule --
def test_the_count_alone_does_not_stop_before_the_time_without_a_commit():
    clock = Clock()
    budget = FailedSaves(3, 300.0, clock)
    said = []
    for failed in (1, 2, 3, 4):              # four saves fail within 40 s
        clock.now += 10
        assert budget.count(failed) and not budget.spent()
        said.append(budget.waiting())
    assert budget.in_a_row == 4 and budget.seconds_without_commit == 40
    assert said[0] is None and said[1] is None and said[3] is None   # once a row
    assert said[2] == ("3 save(s) in a row failed, none committed for 30 s: training goes "
                       "on until 300 s without a commit (checkpoint.max_failed_saves_s)")
    clock.now += 259.5
    assert budget.count(5) and not budget.spent()     # 299.5 s
    clock.now += 0.5
    assert budget.count(6) and budget.spent()         # 300 s without a commit
    assert budget.why("the save of step 12 failed").startswith(
        "6 save(s) in a row failed and none committed for 300 s (checkpoint.max_failed_saves=3, "
        "max_failed_saves_s=300), the last: the save of step 12 failed")


def test_the_time_alone_does_not_stop_before_the_count():
    clock = Clock()
    budget = FailedSaves(3, 300.0, clock)
    clock.now += 3600                         # an hour since the start, then two failures
    assert budget.count(1) and not budget.spent()
    assert budget.waiting() is None           # the count is not spent: nothing more to say
    assert budget.count(2) and not budget.spent()
    assert budget.count(3) and budget.spent()


def test_a_commit_restarts_the_time_and_a_good_save_the_count():
    clock = Clock()
    budget = FailedSaves(3, 300.0, clock)
    clock.now += 290
    budget.committed()                        # the storage came back for one save
    for failed in (1, 2, 3):
        clock.now += 100
        budget.count(failed)
    assert budget.spent()                     # 300 s since that commit
    budget = FailedSaves(3, 300.0, clock)
    assert budget.count(1) and budget.count(2)
    assert not budget.count(2) and budget.in_a_row == 0   # no new failure: the row ends
    clock.now += 1000
    assert budget.count(3) and not budget.spent()          # one in a row, not three


def test_no_time_budget_is_the_count_alone():
    budget = FailedSaves(2, 0.0, Clock())
    assert budget.count(1) and not budget.spent()
    assert budget.count(2) and budget.spent()
    assert budget.why("x") == "2 save(s) in a row failed, the last: x"


# ------------------------------------------------------ in the save policy --
@pytest.fixture
def metrics(tmp_path):
    log = metrics_mod.MetricsLog(str(tmp_path / "logs"), stream=io.StringIO())
    yield log
    log.close()


def policy_on(clock: Clock, metrics, *, max_failed_s: float = 300.0):
    pipeline = FakePipeline()
    pipeline.outage = True                     # failures are an unreachable store
    policy = policy_mod.SavePolicy(
        pipeline, interval_steps=1, final_step=10_000, state=lambda: {"progress": Progress()},
        record=dict, metrics=metrics, wait_timeout_s=5.0, max_failed_in_a_row=3,
        max_failed_s=max_failed_s, clock=clock)
    return policy, pipeline


def test_an_outage_shorter_than_the_time_budget_costs_no_stop_at_a_short_interval(metrics):
    """A save every step (1 s) and the store away for 60 s: 60 saves fail in a row, far
    past checkpoint.max_failed_saves, and training goes on and commits again after."""
    clock = Clock()
    policy, pipeline = policy_on(clock, metrics)
    boundary = FakeBoundary()
    policy.decide(1, boundary)
    policy.decide(2, boundary)                # step 1 committed
    pipeline.failures = 60
    decisions = []
    for step in range(3, 70):
        clock.now += 1.0
        decisions.append(policy.decide(step, boundary))
    assert not any(d.stop for d in decisions)
    assert pipeline.failed_saves == 60 and pipeline.last_committed.step > 62
    assert policy.failed_in_a_row == 0        # it committed again: the row is over
    assert "training goes on until 300 s without a commit" in metrics.stream.getvalue()


def test_a_storage_that_stays_broken_stops_once_the_time_without_a_commit_is_spent(metrics):
    clock = Clock()
    policy, pipeline = policy_on(clock, metrics, max_failed_s=30.0)
    boundary = FakeBoundary()
    policy.decide(1, boundary)
    clock.now += 100.0                        # the time counts from the commit, not the start
    policy.decide(2, boundary)                # step 1 commits (found at step 2)
    committed_at = clock.now
    pipeline.failures = 10**9
    for step in range(3, 1000):
        clock.now += 2.0                      # a step and its failing save take 2 s
        decision = policy.decide(step, boundary)
        if decision.stop:
            break
    assert (decision.stop, decision.why) == (True, "not_saved")
    assert 30.0 <= clock.now - committed_at <= 30.0 + 2.0   # within one interval of the budget
    assert decision.detail.startswith("15 save(s) in a row failed and none committed for 30 s")
    assert pipeline.saves[-1][0] == step - 1   # nothing started at the stop


def test_the_configuration_feeds_the_budget_and_on_error_stop_keeps_the_first_failure(
        tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointer_mod, "choose_and_load", lambda *args: None)

    def budget(*overrides: str):
        checkpointer = make_checkpointer(tmp_path, overrides=overrides)
        checkpointer.load(FakeTraining())
        failures = checkpointer.policy.failures
        return failures.max_in_a_row, failures.max_without_commit_s

    assert budget() == (3, 300.0)                                 # the defaults
    assert budget("checkpoint.max_failed_saves_s=42", "checkpoint.max_failed_saves=5") == (5, 42)
    assert budget("checkpoint.on_error=stop") == (1, 0.0)         # the first failure stops


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_time_budget_is_refused_naming_the_key(value):
    config = project_module("config")
    with pytest.raises(config.ConfigError, match="checkpoint.max_failed_saves_s"):
        config.load_config(ROOT / "configs/train.yaml", [f"checkpoint.max_failed_saves_s={value}"])


# ------------------------------------------------------------- two ranks --
def _decide_on_two_ranks(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        clock = Clock()
        budget = FailedSaves(1, 300.0, clock)
        clock.now += 10.0 if rank == 0 else 1000.0   # rank 1's clock runs far ahead
        budget.count(1)
        results[rank] = (budget.spent(), budget.seconds_without_commit)
    finally:
        dist.destroy_process_group()


def test_every_rank_decides_by_rank_0s_clock():
    """Rank 1's clock says 1000 s without a commit, rank 0's 10 s: both go on, as rank 0
    decides (a rank that stopped alone would leave the other waiting in a collective)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.get_context("spawn").Manager() as shared:
        results = shared.dict()
        mp.start_processes(_decide_on_two_ranks, args=(port, results), nprocs=2,
                           start_method="spawn")
        assert dict(results) == {0: (False, 10.0), 1: (False, 10.0)}
