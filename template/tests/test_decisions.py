"""The checkpoint decisions in-process, with fakes: when to save, when to stop, who writes.

No process group, no subprocess: the save policy and the checkpointer run against a fake
checkpoint pipeline and a fake step boundary (the collectives decide locally when
torch.distributed is not initialized); the stop vote runs over a real PreemptionWatch;
the lease over a real local directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch

from conftest import ROOT, project_module

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api

policy_mod = project_module("checkpoint.policy")
checkpointer_mod = project_module("checkpoint.checkpointer")
lease_mod = project_module("checkpoint.store.lease")
SaveResult = project_module("checkpoint.save.pipeline").SaveResult
Committed = project_module("checkpoint.store.layout").Committed
Progress = project_module("checkpoint.state").Progress
metrics_mod = project_module("runtime.metrics")
distributed = project_module("runtime.distributed")
stop_mod = project_module("preemption.stop")
watch_mod = project_module("preemption.watch")
Vote = stop_mod.Vote

GRACE = 30.0


# ------------------------------------------------------------------ fakes --
class FakePipeline:
    """A SavePipeline that writes nothing: an asynchronous save is in flight until the
    next poll/wait, which commits it at once (``slow``: the next wait); a blocking save commits at once. The next
    ``failures`` saves fail: a blocking one raises, an asynchronous one fails in the
    background (recorded at the next poll/wait), as DCP's do."""

    class Mode:
        value = "process"

    def __init__(self, *, write_s: float = 0.01) -> None:
        self.mode = self.Mode()
        self.storage, self.verify = None, "all"   # what the load is handed (never used here)
        self.write_s = write_s
        self.saves: list[tuple[int, str, bool]] = []   # (step, reason, blocking)
        self.failures = 0
        self.failed_saves = 0
        self.last_error: str | None = None
        self.last_committed: SaveResult | None = None
        self.in_flight_step: int | None = None
        self._reason = ""
        self._failing = False
        self.prestaged = 0
        self.warmed = 0
        self.readied = 0
        self.abandoned = False
        self.closed = False
        self.slow = False   # a save in flight is still being written: only wait() ends it
        self.stuck = False  # ...and wait() too times out (storage slow or away)
        self.age = 0.0      # seconds the save in flight has been in flight
        self.outage = False  # failures are unreachable storage, not a broken process
        self.broken_save = False

    @property
    def in_flight(self) -> bool:
        return self.in_flight_step is not None

    @property
    def in_flight_s(self) -> float:
        return self.age if self.in_flight else 0.0

    def warm_up(self, state, timeout_s, process_log=None):
        self.warmed += 1

    def wait_ready(self):
        self.readied += 1

    def give_up_start(self):
        self.gave_up_start = True

    def prestage(self, state) -> None:
        self.prestaged += 1

    def save(self, step, state, reason, record, *, blocking=False):
        assert not self.in_flight, "a save started while another was in flight"
        self.saves.append((step, reason, blocking))
        failing = self.failures > 0
        self.failures -= failing
        if blocking and failing:
            raise OSError("No space left on device")
        self.in_flight_step, self._reason, self._failing = step, reason, failing
        return self._settle("sync") if blocking else None

    def _settle(self, mode: str = "process"):
        if self.in_flight_step is None:
            return None
        step, self.in_flight_step = self.in_flight_step, None
        if self._failing:
            error = (ConnectionRefusedError(111, "Connection refused") if self.outage
                     else OSError("No space left on device"))
            self.record_failure(step, error, "failed")
            return None
        self.last_committed = SaveResult(step, self._reason, mode, 0.001, 0.002,
                                         f"/ckpt/step_{step:09d}", write_s=self.write_s)
        return self.last_committed

    def poll(self):
        return None if self.slow else self._settle()

    def wait(self, timeout=None):
        if self.stuck:
            time.sleep(min(timeout or 0.0, 0.01))
            raise TimeoutError
        return self._settle()

    def wait_staged(self) -> None:
        pass

    def abandon(self, why: str = ""):
        self.in_flight_step = None
        self.abandoned = True

    def record_failure(self, step, exc, what):
        self.broken_save |= not isinstance(exc, ConnectionError)
        self.failed_saves += 1
        self.last_error = f"the save of step {step} {what}: {exc}"
        return self.last_error

    def close(self):
        self.closed = True
        return self._settle()


class FakeBoundary:
    """The stop protocol as the policy sees it: ``stop_at`` set is a stop request."""

    def __init__(self, source: str = "SIGTERM", detail: str = "") -> None:
        self.grace_period_s = GRACE
        self.stop_at: float | None = None
        self.source, self.detail = source, detail
        self.votes = 0

    @property
    def requested(self) -> bool:
        return self.stop_at is not None

    @property
    def signals_received(self) -> int:
        return int(self.requested)

    def vote(self, failed_saves: int = 0):
        self.votes += 1
        return Vote(self.stop_at, failed_saves)

    def agreed_source(self, step: int):
        return self.source, 0, self.detail, [step]


class Allowance:
    """The watchdog's ``allow(seconds)``: records every time it is entered."""

    def __init__(self) -> None:
        self.entered: list[float] = []

    def __call__(self, seconds: float = 0.0):
        @contextlib.contextmanager
        def allowed():
            self.entered.append(seconds)
            yield
        return allowed()


class FakeTraining:
    """A TrainingState (checkpoint.load.restore) with nothing to train."""

    uses_default_schedule = True

    def __init__(self, step: int = 0) -> None:
        self.progress = Progress(step=step)

    def state(self, *, with_rng: bool = True):
        return {"progress": self.progress}

    def commit_record(self):
        return {"world_size": 1}

    def model_shapes(self):
        return {}

    def reseed(self, step: int) -> None:
        pass


@pytest.fixture(autouse=True)
def no_process_group():
    # The collectives must decide locally: these tests fake the other ranks away.
    assert not torch.distributed.is_initialized()


@pytest.fixture
def metrics(tmp_path):
    log = metrics_mod.MetricsLog(str(tmp_path / "logs"), stream=io.StringIO())
    yield log
    log.close()


def events(metrics, kind: str) -> list[dict]:
    return metrics_mod.read_events(metrics.path, kind)[0]


def said(metrics) -> str:
    return metrics.stream.getvalue()


def make_policy(pipeline, metrics, *, interval: int = 4, final: int = 10,
                max_failed: int = 3, allowance=contextlib.nullcontext):
    return policy_mod.SavePolicy(
        pipeline, interval_steps=interval, final_step=final,
        state=lambda: {"progress": Progress()}, record=dict, metrics=metrics,
        wait_timeout_s=5.0, max_failed_in_a_row=max_failed, allowance=allowance)


# -------------------------------------------------------- (a) the save policy --
def test_saves_are_due_every_interval_and_at_the_final_step(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    policy = make_policy(pipeline, metrics, interval=4, final=10)
    decisions = {step: policy.decide(step, boundary) for step in range(1, 11)}
    assert pipeline.saves == [(4, "interval", False), (8, "interval", False), (10, "final", False)]
    assert [s for s, d in decisions.items() if d.saved] == [4, 8, 10]
    assert decisions[10].why == "final" and not any(d.stop for d in decisions.values())
    assert boundary.votes == 10                       # every step boundary votes
    assert [e["step"] for e in events(metrics, "save")] == [4, 8]  # 10 still in flight


def test_a_due_save_does_not_wait_for_an_overdue_save_and_is_left_to_the_next(metrics):
    """Storage slow or away: the save in flight is overdue. The due save neither waits
    for it on the training path nor starts a second one; said once; once the late save
    is written, the next due step saves. A late save older than wait_timeout_s is given
    up and the due save starts."""
    pipeline, boundary = FakePipeline(), FakeBoundary()
    policy = policy_mod.SavePolicy(
        pipeline, interval_steps=4, final_step=100, state=lambda: {"progress": Progress()},
        record=dict, metrics=metrics, wait_timeout_s=60.0, max_failed_in_a_row=3)
    assert policy.decide(4, boundary).saved                # in flight
    pipeline.slow = pipeline.stuck = True
    pipeline.age = policy.overdue_after_s() + 1
    began = time.perf_counter()
    decision = policy.decide(8, boundary)
    assert time.perf_counter() - began < 1.0               # no wait on the training path
    assert not decision.saved and not decision.stop
    assert pipeline.saves == [(4, "interval", False)] and pipeline.in_flight_step == 4
    assert "the save of step 4 is still being written" in said(metrics)
    assert not policy.decide(12, boundary).saved
    assert said(metrics).count("still being written") == 1
    pipeline.slow = pipeline.stuck = False
    assert policy.decide(16, boundary).saved               # written meanwhile: saves again
    assert [step for step, _, _ in pipeline.saves] == [4, 16]
    # Not yet overdue: the due save waits for it, as always.
    pipeline.age = policy.overdue_after_s() - 1
    assert policy.decide(20, boundary).saved and [s for s, _, _ in pipeline.saves][-1] == 20
    # Older than checkpoint.wait_timeout_s: given up, and the due save starts.
    pipeline.slow = pipeline.stuck = True
    pipeline.age = 61.0
    assert policy.decide(24, boundary).saved and pipeline.abandoned
    assert [s for s, _, _ in pipeline.saves][-1] == 24


def test_the_last_step_saves_as_final_before_the_final_step(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    policy = make_policy(pipeline, metrics, interval=4, final=100)
    assert not policy.decide(6, boundary).saved
    decision = policy.decide(7, boundary, last_step=True)
    assert decision.saved and decision.why == "final"
    assert pipeline.saves == [(7, "final", False)]


def test_no_save_without_a_trained_step(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    policy = make_policy(pipeline, metrics, interval=4, final=8)
    decision = policy.decide(8, boundary, trained=False, last_step=True)
    assert decision == policy_mod.StepDecision()
    assert pipeline.saves == [] and boundary.votes == 1  # it still votes


def test_a_stop_vote_drains_the_save_in_flight_then_saves_at_the_stop(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary("SIGTERM")
    policy = make_policy(pipeline, metrics, interval=4, final=100)
    for step in range(1, 5):
        policy.decide(step, boundary)
    assert pipeline.in_flight_step == 4
    pipeline.slow = True                               # still being written at the stop
    boundary.stop_at = time.time()
    decision = policy.decide(5, boundary)
    assert (decision.stop, decision.saved, decision.why) == (True, True, "preempted")
    assert pipeline.saves == [(4, "interval", False), (5, "preemption", True)]
    (stop,) = events(metrics, "preemption")
    assert (stop["source"], stop["stop_step"], stop["drained_step"],
            stop["final_checkpoint_step"], stop["resume_step"]) == ("SIGTERM", 5, 4, 5, 5)
    assert stop["final_save_skipped_reason"] is None and 0 <= stop["signal_to_commit_s"] < GRACE


def test_a_stop_at_a_step_already_committed_saves_nothing_more(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary("SIGUSR1")
    policy = make_policy(pipeline, metrics)
    policy.resumed_from = Committed(6, "step_000000006", "/ckpt/step_000000006",
                                    {"world_size": 1, "write_s": 0.5})
    boundary.stop_at = time.time()
    decision = policy.decide(6, boundary, trained=False)  # the call before the first step
    assert (decision.stop, decision.saved, decision.why) == (True, False, "preempted")
    assert pipeline.saves == []
    (stop,) = events(metrics, "preemption")
    assert stop["final_save_skipped_reason"] == "checkpoint at step 6 already committed"
    assert stop["resume_step"] == 6 and stop["save_estimate_s"] == 0.5


def test_a_stop_skips_the_final_save_when_the_measured_save_exceeds_the_grace_left(metrics):
    pipeline, boundary = FakePipeline(write_s=2 * GRACE), FakeBoundary("aws-notice", "terminate")
    policy = make_policy(pipeline, metrics, interval=4, final=100)
    for step in range(1, 6):
        policy.decide(step, boundary)
    assert pipeline.last_committed.step == 4           # measured: a save takes 2 x the grace
    boundary.stop_at = time.time()
    decision = policy.decide(6, boundary)
    assert (decision.stop, decision.saved, decision.why) == (True, False, "preempted")
    assert [s for s, _, _ in pipeline.saves] == [4]    # no final save started
    (stop,) = events(metrics, "preemption")
    assert "s of grace left, a save takes about 60.00 s (measured)" in \
        stop["final_save_skipped_reason"]
    assert stop["resume_step"] == 4 and stop["final_checkpoint_step"] is None
    assert "no final checkpoint" in said(metrics) and "aws-notice: terminate" in said(metrics)


def test_ctrl_c_stops_as_interrupted_not_preempted(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary("SIGINT")
    policy = make_policy(pipeline, metrics, interval=4, final=100)
    boundary.stop_at = time.time()
    decision = policy.decide(3, boundary)
    assert (decision.stop, decision.saved, decision.why) == (True, True, "interrupted")
    assert pipeline.saves == [(3, "preemption", True)]
    assert "interrupted by the user" in said(metrics)


def test_a_failed_save_makes_later_saves_synchronous(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    policy = make_policy(pipeline, metrics, interval=2, final=100, max_failed=3)
    pipeline.failures = 1
    assert policy.decide(2, boundary).saved           # fails in the background
    policy.decide(3, boundary)                        # the failure is found
    assert pipeline.failed_saves == 1 and not policy.synchronous
    decision = policy.decide(4, boundary)
    assert decision.saved and not decision.stop
    assert pipeline.saves == [(2, "interval", False), (4, "interval", True)]
    (changed,) = events(metrics, "save_mode_changed")
    assert (changed["step"], changed["mode"]) == (4, "sync")
    assert "a background save failed" in changed["reason"]
    policy.decide(6, boundary)
    assert pipeline.saves[-1] == (6, "interval", True)  # stays synchronous


def test_a_save_failed_on_unreachable_storage_keeps_saves_in_the_background(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    pipeline.outage = True
    policy = make_policy(pipeline, metrics, interval=2, final=100, max_failed=3)
    pipeline.failures = 1
    assert policy.decide(2, boundary).saved           # fails in the background
    policy.decide(3, boundary)                        # the failure is found
    assert policy.decide(4, boundary).saved and not policy.synchronous
    assert pipeline.saves == [(2, "interval", False), (4, "interval", False)]
    assert not events(metrics, "save_mode_changed")


def test_saves_failing_max_times_in_a_row_stop_as_not_saved(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    policy = make_policy(pipeline, metrics, interval=2, final=100, max_failed=3)
    pipeline.failures = 3
    decisions = [policy.decide(step, boundary) for step in (2, 4, 6)]
    assert not any(d.stop for d in decisions)
    assert [d.saved for d in decisions] == [True, False, False]  # 4 and 6 raised
    decision = policy.decide(8, boundary)
    assert (decision.stop, decision.saved, decision.why) == (True, False, "not_saved")
    assert decision.detail.startswith("3 save(s) in a row failed, the last: ")
    assert "the save of step 6 failed: No space left on device" in decision.detail
    assert [s for s, _, _ in pipeline.saves] == [2, 4, 6]  # nothing started at 8


def test_a_successful_save_resets_the_failures_in_a_row(metrics):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    policy = make_policy(pipeline, metrics, interval=2, final=100, max_failed=3)
    pipeline.failures = 2
    for step in (2, 4, 6):                  # 2 and 4 fail, 6 commits
        assert not policy.decide(step, boundary).stop
    assert pipeline.last_committed.step == 6 and policy.failed_in_a_row == 2
    assert not policy.decide(8, boundary).stop  # no new failure: the count starts again
    assert policy.failed_in_a_row == 0
    pipeline.failures = 2                      # two more: not three in a row
    for step in (10, 12, 14):
        assert not policy.decide(step, boundary).stop, step
    assert policy.failed_in_a_row == 2 and pipeline.failed_saves == 4


# ----------------------------------------------------- (b) the checkpointer --
def make_checkpointer(tmp_path, *, newest_step=None, overrides=(), allow=None,
                      pipeline=None, boundary=None):
    cfg = project_module("config").load_config(
        ROOT / "configs/train.yaml",
        ["checkpoint.interval_steps=4", "train.max_steps=10", f"log.dir={tmp_path / 'logs'}",
         f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])
    runtime = distributed.Runtime(0, 1, 0, torch.device("cpu"), "gloo")
    return checkpointer_mod.Checkpointer(
        cfg, runtime, metrics_mod.MetricsLog(None), boundary or FakeBoundary(),
        pipeline or FakePipeline(), None, newest_step, allow)


@pytest.fixture
def nothing_to_resume(monkeypatch):
    monkeypatch.setattr(checkpointer_mod, "choose_and_load", lambda *args: None)


def test_first_start_is_whether_a_checkpoint_was_committed(tmp_path):
    assert make_checkpointer(tmp_path, newest_step=None).first_start
    assert not make_checkpointer(tmp_path, newest_step=12).first_start


def test_saving_before_load_is_refused(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    with pytest.raises(RuntimeError, match="load must come before the first step"):
        checkpointer.at_step_end(1)


def test_the_call_at_the_start_step_only_votes(tmp_path, nothing_to_resume):
    pipeline, boundary, allow = FakePipeline(), FakeBoundary(), Allowance()
    checkpointer = make_checkpointer(tmp_path, pipeline=pipeline, boundary=boundary, allow=allow)
    assert checkpointer.load(FakeTraining(step=8)) is None
    decision = checkpointer.at_step_end(8)          # a due step, but nothing trained yet
    assert not decision.saved and not decision.stop
    assert pipeline.saves == [] and boundary.votes == 1 and pipeline.warmed == 1
    # Only the warm-up's own bound (the checkpoint process's start), no save's.
    assert allow.entered == [checkpointer.cfg.checkpoint.start_timeout_s]
    assert decision.newest == "no save yet"
    checkpointer.at_step_end(9)
    assert pipeline.prestaged == 1 and pipeline.warmed == 1  # warmed once; staged when trained


def test_the_last_step_saves_as_final_and_close_says_finished(tmp_path, nothing_to_resume):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    checkpointer = make_checkpointer(tmp_path, pipeline=pipeline, boundary=boundary)
    checkpointer.load(FakeTraining())
    for step in range(6):
        checkpointer.at_step_end(step)
    decision = checkpointer.at_step_end(6, last_step=True)
    assert decision.saved and decision.why == "final"
    assert pipeline.saves == [(4, "interval", False), (6, "final", False)]
    outcome = checkpointer.close(6, decision)
    assert pipeline.closed and outcome.why == "finished" and outcome.saved


def test_close_says_not_saved_when_the_final_save_did_not_commit(tmp_path, nothing_to_resume):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    checkpointer = make_checkpointer(tmp_path, pipeline=pipeline, boundary=boundary)
    checkpointer.load(FakeTraining())
    for step in range(10):
        checkpointer.at_step_end(step)
    pipeline.failures = 1
    decision = checkpointer.at_step_end(10, last_step=True)   # fails in the background
    outcome = checkpointer.close(10, decision)
    assert outcome.why == "not_saved" and not outcome.stop
    assert "the final checkpoint of step 10 did not commit" in outcome.detail
    assert "No space left on device" in outcome.detail
    assert outcome.detail.endswith("the newest committed checkpoint is step 8")


def test_the_watchdog_allowance_covers_saves_and_stops_only(tmp_path, nothing_to_resume):
    pipeline, boundary, allow = FakePipeline(), FakeBoundary(), Allowance()
    checkpointer = make_checkpointer(tmp_path, pipeline=pipeline, boundary=boundary, allow=allow)
    cfg = checkpointer.cfg
    checkpointer.load(FakeTraining())
    checkpointer.at_step_end(0)                                # the start: the warm-up's bound
    assert allow.entered == [cfg.checkpoint.start_timeout_s]
    allow.entered.clear()
    for step in (1, 2, 3):
        checkpointer.at_step_end(step)
    assert allow.entered == []                          # plain steps: the usual bound
    checkpointer.at_step_end(4)
    assert len(allow.entered) >= 1                      # around the due save
    # Before any measured save: the first-step bound stands for the save's own time.
    assert allow.entered[0] == pytest.approx(cfg.checkpoint.wait_timeout_s
                                             + cfg.recovery.first_step_timeout_s)
    before = len(allow.entered)
    checkpointer.at_step_end(5)
    assert len(allow.entered) == before                 # plain again
    boundary.stop_at = time.time()
    decision = checkpointer.at_step_end(6)
    assert decision.stop and decision.why == "preempted"
    assert len(allow.entered) > before                  # around the stop
    # Measured now: four times the newest write replaces the first-step bound; a stop
    # gets the grace period instead of the wait for the save in flight.
    assert allow.entered[-1] == pytest.approx(GRACE + 4 * pipeline.write_s)


def test_close_after_failing_saves_names_the_newest_committed_step(tmp_path, nothing_to_resume):
    pipeline, boundary = FakePipeline(), FakeBoundary()
    checkpointer = make_checkpointer(tmp_path, pipeline=pipeline, boundary=boundary,
                                     overrides=["checkpoint.on_error=stop", "train.max_steps=100"])
    checkpointer.load(FakeTraining())
    for step in range(9):
        checkpointer.at_step_end(step)
    pipeline.failures = 1
    checkpointer.at_step_end(12)                       # fails in the background
    decision = checkpointer.at_step_end(16)            # on_error: stop — one failure is enough
    assert (decision.stop, decision.why) == (True, "not_saved")
    outcome = checkpointer.close(16, decision)
    assert outcome.why == "not_saved"
    assert outcome.detail.endswith("; the newest committed checkpoint is step 8")


# --------------------------------------------------------- (c) the stop vote --
@pytest.fixture
def coordinator(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)   # not under torchrun
    watch = watch_mod.PreemptionWatch(["SIGTERM", "SIGUSR1"])     # never installed
    runtime = distributed.Runtime(0, 1, 0, torch.device("cpu"), "gloo")
    return stop_mod.StopCoordinator(watch, runtime, GRACE)


def test_no_request_votes_to_go_on(coordinator):
    assert coordinator.launcher_pid is None
    assert coordinator.vote(failed_saves=2) == Vote(None, 2)
    assert not coordinator.requested


def test_a_request_votes_its_wall_time(coordinator):
    before = time.time()
    coordinator.watch.request("SIGTERM")
    after = time.time()
    vote = coordinator.vote()
    assert vote.stop_at is not None and before <= vote.stop_at <= after
    assert vote.failed_saves == 0 and coordinator.requested
    coordinator.watch.request("SIGUSR1")          # a later one changes nothing
    assert coordinator.vote() == vote and coordinator.signals_received == 2


def test_a_launcher_that_went_away_votes_to_stop(coordinator):
    coordinator.launcher_pid = os.getppid()       # the launcher is still the parent
    assert coordinator.vote().stop_at is None
    coordinator.launcher_pid = os.getpid()        # never this process's parent
    vote = coordinator.vote()
    assert vote.stop_at is not None
    source, rank, detail, steps = coordinator.agreed_source(7)
    assert (source, rank, steps) == ("launcher-gone", 0, [7])
    assert f"the parent process {os.getpid()} (torchrun) has exited" in detail


def test_agreed_source_is_the_requests(coordinator):
    coordinator.watch.request("aws-notice", "terminate at 2026-11-29T10:00:00Z")
    coordinator.watch.request("SIGTERM")
    assert coordinator.agreed_source(5) == ("aws-notice", 0, "terminate at 2026-11-29T10:00:00Z",
                                            [5])


# ------------------------------------------------------------- (d) the lease --
@pytest.fixture
def lease_root(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_mod, "POLL_S", 0.01)   # waits for a live lease end quickly
    return project_module("checkpoint.store.storage").LocalStorage(tmp_path / "ckpt")


def lease_of(storage, job: str, monkeypatch, *, stale_s: float = 60.0, wait_s: float = 0.05):
    """A Lease as the job named ``job`` would take it (same host and process here)."""
    monkeypatch.setattr(lease_mod, "this_job_id", lambda: job)
    return lease_mod.Lease(storage, stale_s=stale_s, wait_s=wait_s)


def test_a_lease_is_acquired_on_an_empty_directory(lease_root, monkeypatch):
    first = lease_of(lease_root, "job-A", monkeypatch)
    assert first.acquire() is None and first.held
    owner = first.owner()
    assert (owner.job_id, owner.pid) == ("job-A", os.getpid())
    assert first.acquire() is None                 # its own lease: taken again, no notice


def test_a_live_lease_of_another_job_is_refused(lease_root, monkeypatch):
    first = lease_of(lease_root, "job-A", monkeypatch)
    first.acquire()
    second = lease_of(lease_root, "job-B", monkeypatch, wait_s=0.1)
    began = time.monotonic()
    with pytest.raises(lease_mod.LeaseHeld, match=r"is in use by job job-A .*another "
                                                  r"checkpoint.dir"):
        second.acquire()
    assert time.monotonic() - began >= 0.1          # it waited for a release first
    assert not second.held and first.owner().job_id == "job-A"


def test_a_stale_lease_is_taken_over(lease_root, monkeypatch):
    first = lease_of(lease_root, "job-A", monkeypatch)
    first.acquire()
    time.sleep(0.2)
    second = lease_of(lease_root, "job-B", monkeypatch, stale_s=0.1)
    notice = second.acquire()
    assert notice is not None and notice.startswith("took over the lease of job job-A")
    assert "no heartbeat for" in notice
    assert second.owner().job_id == "job-B" and second.held


def test_release_frees_the_lease_for_another_job(lease_root, monkeypatch):
    first = lease_of(lease_root, "job-A", monkeypatch)
    first.acquire()
    first.release()
    assert first.owner() is None and not first.held
    second = lease_of(lease_root, "job-B", monkeypatch)
    assert second.acquire() is None and second.owner().job_id == "job-B"


def test_the_heartbeat_renews_the_lease_and_notices_a_takeover(lease_root, monkeypatch):
    first = lease_of(lease_root, "job-A", monkeypatch, stale_s=0.4)   # a beat every 0.5 s
    first.acquire()
    written = first.owner().heartbeat
    first.start_heartbeat()
    try:
        deadline = time.monotonic() + 5
        while first.owner().heartbeat == written and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.owner().heartbeat > written, "the heartbeat did not renew the lease"
        second = lease_of(lease_root, "job-B", monkeypatch, stale_s=60, wait_s=0.05)
        with pytest.raises(lease_mod.LeaseHeld):   # renewed: live for a fresh job too
            second.acquire()
        # Taken over by force (as a job that judged it stale would): the beat lets go.
        monkeypatch.setattr(second, "_gone", lambda owner, now: "judged stale")
        second.acquire()
        deadline = time.monotonic() + 5
        while first.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not first.held
    finally:
        first.release()
    assert second.owner().job_id == "job-B"       # a release never removes another's lease


def test_the_heartbeat_survives_any_error_and_lets_go_once_the_lease_could_go_stale(
        lease_root, monkeypatch):
    """A store that fails with something other than OSError (a connection error of an
    object-store client) must not kill the heartbeat; renewals failing for longer than
    lease_stale_s mean another job may take over: this one stops holding the lease, so its
    commits stop."""
    first = lease_of(lease_root, "job-A", monkeypatch, stale_s=1.0)   # a beat every 0.5 s
    first.acquire()
    failing = {"on": True}
    real_write = lease_root.write_text_durable

    def flaky_write(name, text):
        if failing["on"]:
            raise RuntimeError("EndpointConnectionError: could not connect to the endpoint")
        return real_write(name, text)

    monkeypatch.setattr(lease_root, "write_text_durable", flaky_write)
    first.start_heartbeat()
    try:
        deadline = time.monotonic() + 6
        while first.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not first.held, "a lease not renewed for lease_stale_s is still held"
        assert first._thread.is_alive(), "the heartbeat died on a non-OSError"
    finally:
        failing["on"] = False
        first.release()


def test_the_checkpoint_process_is_waited_for_by_the_first_save_not_by_a_stop(
        tmp_path, nothing_to_resume):
    """It starts while the first steps train; the first due save waits for it. A stop
    saves synchronously without it, and the end leaves a start still under way behind."""
    pipeline, boundary = FakePipeline(), FakeBoundary()
    checkpointer = make_checkpointer(tmp_path, pipeline=pipeline, boundary=boundary)
    checkpointer.load(FakeTraining())
    checkpointer.at_step_end(0)
    assert pipeline.warmed == 1 and pipeline.readied == 0       # started, not waited for
    for step in (1, 2, 3):
        checkpointer.at_step_end(step)
    assert pipeline.readied == 0 and pipeline.saves == []
    checkpointer.at_step_end(4)                                       # due: waits, then saves
    assert pipeline.readied == 1 and pipeline.saves == [(4, "interval", False)]
    checkpointer.at_step_end(5)
    assert pipeline.readied == 1                                # once

    pipeline, boundary = FakePipeline(), FakeBoundary()
    checkpointer = make_checkpointer(tmp_path, pipeline=pipeline, boundary=boundary)
    checkpointer.load(FakeTraining())
    checkpointer.at_step_end(0)
    boundary.stop_at = time.time()
    decision = checkpointer.at_step_end(1)                            # a stop before any save
    assert decision.stop and pipeline.readied == 0
    assert pipeline.saves == [(1, "preemption", True)]          # synchronous, no process
    checkpointer.close(1, decision)
    assert pipeline.readied == 0 and getattr(pipeline, "gave_up_start", False)
