"""The benchmark runs end to end and reports figures that make sense."""

import json
import time

import pytest

from conftest import project_module, run_module, torchrun

TINY = ["model.d_model=32", "model.n_layers=1"]
PARTS = project_module("config.parts")
# The memory tier's figures come with the memory tier (the copier answer memory_tier).
MEMORY = PARTS.rendered(PARTS.MEMORY_TIER)
FIGURES = ("baseline", "dcp_sync", "disk_bound", "async_blocking", "async_commit",
           "copy_bound", "read_bound", "load", "verify", "baseline_load",
           *(("memory_save", "memory_load", "memory_load_sampled", "memory_load_checked",
              "memory_check") if MEMORY else ()))
RATIOS = ("baseline/blocking", "blocking/copy_bound", "commit/disk_bound", "load/read_bound",
          "stall/copy_bound", "stall/dcp_sync", "memory_save/copy_bound", "load/memory_load",
          "load/memory_load_sampled", "load/memory_load_checked")


@pytest.mark.slow
def test_bench_reports_every_figure_ratio_and_plan_cache_hits():
    proc = torchrun(2, "bench", "--repeats", "2", "--json", *TINY)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2
    med = report["median_s"]
    for name in FIGURES:
        assert med[name] > 0, (name, report)
    assert isinstance(med["stall"], float), report   # a difference of step times: may be < 0
    assert med["async_commit"] >= med["async_blocking"]
    assert set(report["ratios"]) == set(RATIOS)
    memory_ratios = {name for name in RATIOS if "memory" in name}
    assert all(isinstance(value, float) for name, value in report["ratios"].items()
               if MEMORY or name not in memory_ratios)
    loop = report["loop"]
    assert loop["counts"]["save"] == 3 and loop["counts"]["clean"] >= 1, loop
    assert loop["failed_saves"] == 0
    assert report["first_save"]["blocking_s"] > 0
    assert report["plan_cache_hits"] == 2          # every timed save after the warm-up
    assert report["staged_fast"] >= 3              # saves after the first reuse the buffers
    assert report["staging_bytes_per_rank"] > 0
    if MEMORY:
        assert report["memory_held_bytes_rank0"] >= report["state_bytes_rank0"]   # its two slots
    else:
        assert report["memory_held_bytes_rank0"] is None and "memory_save" not in med


@pytest.mark.slow
def test_bench_train_steps_prints_the_throughput_ratio():
    proc = torchrun(2, "bench", "--train-steps", "6", "--interval", "3", "--repeats", "1",
                    "--json", *TINY)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["train_steps"] == 6 and report["interval"] == 3
    assert report["samples_per_s"]["with"] > 0 and report["samples_per_s"]["without"] > 0
    assert 0 < report["throughput_ratio"] < 10
    assert report["failed_saves"] == 0


@pytest.mark.slow
def test_bench_restart_times_a_resume_and_a_killed_worker_with_their_phases():
    proc = run_module("bench", "--restart", "--repeats", "1", "--json", *TINY, timeout=400)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["nproc"] == 2 and report["repeats"] == 1
    assert 0 < report["stopped_job_to_first_step_s"] < 120
    assert 0 < report["worker_death_to_first_step_s"] < 120
    resumed, killed = report["stopped_job_phases_s"], report["worker_death_phases_s"]
    assert next(iter(resumed)) == "launched -> process_started"
    assert next(iter(killed)) == "killed -> failure_detected"
    for phases in (resumed, killed):
        assert list(phases)[-3:] == ["checkpoint_chosen", "loaded", "first_step"]
    # Each figure is the sum of its phases (the first counted from the launch or kill).
    assert abs(sum(resumed.values()) - report["stopped_job_to_first_step_s"]) < 0.05


def test_bench_restart_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    proc = run_module("bench", "--restart", check=False)
    assert proc.returncode == 2 and "not under torchrun" in proc.stderr
    assert "Traceback" not in proc.stderr


class _EverySaveInFlight:
    """A checkpointer on a machine so busy that each save is still in flight at the next
    save's step: only ``wait_for_save`` finishes one."""

    failed_saves = 0

    def __init__(self):
        self.interval, self.save_in_flight = None, False

    def set_interval(self, steps):
        self.interval = steps

    def save_due(self, step):
        return step > 0 and step % self.interval == 0

    def at_step_end(self, step):
        self.save_in_flight = self.save_in_flight or self.save_due(step)

    def wait_for_save(self):
        self.save_in_flight = False


def test_the_stall_is_measured_when_every_save_is_still_in_flight_at_the_next():
    bench_loop = project_module("tools.bench_loop")

    class Trainer:
        progress = type("Progress", (), {"step": 0})()

        def train_step(self, batches):
            time.sleep(0.001)

    bench = bench_loop.Bench(Trainer(), _EverySaveInFlight(), iter(()))
    figures = bench_loop.measure_stall(bench, saves=3, commit_s=0.0)
    assert figures["counts"]["save"] == 3 and figures["counts"]["clean"] >= 1, figures
    assert isinstance(figures["stall"], float), figures
