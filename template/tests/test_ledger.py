"""The goodput ledger, the measured MTBI and the interruption history, without training.

The χ² quantiles are checked against an independent distribution function (torch's
regularized incomplete gamma), the ledger against a metrics file whose answers are
known by construction, the history against kill -9 and an object store.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, project_module, run_module, suite_env

mtbi = project_module("ledger.mtbi")
accounts = project_module("ledger.accounts")
history = project_module("ledger.history")
storage_mod = project_module("checkpoint.store.storage")
Event = project_module("runtime.metrics").Event


# ------------------------------------------------------------------ the MTBI --
def exact_quantile(p: float, dof: int) -> float:
    """χ²(p; dof) by bisection on torch's incomplete gamma (float64)."""
    low, high = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        middle = (low + high) / 2
        value = torch.special.gammainc(torch.tensor(dof / 2, dtype=torch.float64),
                                       torch.tensor(middle / 2, dtype=torch.float64)).item()
        low, high = (middle, high) if value < p else (low, middle)
    return (low + high) / 2


def test_chi2_quantiles_match_the_published_values():
    for p, dof, value in [(0.025, 2, 0.05064), (0.975, 4, 11.1433), (0.025, 20, 9.5908),
                          (0.975, 22, 36.7807)]:
        assert mtbi.chi2_quantile_even(p, dof) == pytest.approx(value, abs=5e-4)


def test_the_mtbi_interval_is_exact_for_1_to_50_interruptions():
    exposure = 3600.0 * 17
    for n in range(1, 51):
        got = mtbi.measure_mtbi(n, exposure)
        low = 2 * exposure / exact_quantile(0.975, 2 * n + 2)
        high = 2 * exposure / exact_quantile(0.025, 2 * n)
        assert got.estimate_s == pytest.approx(exposure / n)
        assert abs(got.low_s - low) / low < 1e-3 and abs(got.high_s - high) / high < 1e-3, n


def test_the_worked_example_and_the_edges():
    got = mtbi.measure_mtbi(9, 17 * 3600)
    assert got.estimate_s / 3600 == pytest.approx(1.89, abs=0.005)
    assert got.low_s / 3600 == pytest.approx(0.995, abs=0.001)     # 34 / 34.170
    assert got.high_s / 3600 == pytest.approx(4.13, abs=0.005)     # 34 / 8.231
    assert got.excludes(8 * 3600) and not got.excludes(2 * 3600)
    none = mtbi.measure_mtbi(0, 3600.0)
    assert none.estimate_s is None and none.high_s is None and none.low_s > 0
    assert not mtbi.measure_mtbi(2, 3600.0).excludes(1e9)     # too few to say
    with pytest.raises(ValueError):
        mtbi.chi2_quantile_even(0.5, 3)


# ---------------------------------------------------------------- the ledger --
def synthetic_run():
    """Two starts with known answers (seconds):

    start 1: process at t=0; imports 2, rendezvous 1, build 1, load 1 (chosen 0.5 +
             loaded 0.5), first step 1 -> step 1 at t=6; steps 2..6 one second each
             (t=7..11), a save of step 3 blocking 0.25 (+0.25 waited), an evaluation of
             0.5 s logged at t=10.9; killed after step 6 (last event t=11).
    gap:     workers stopped at t=14 (detection 3), the next process at t=20 (queue 6).
    start 2: resumes from step 3; phases 1+1+1+0.5+0.5+1 -> first step (step 4) at t=25;
             steps 5..8 at t=26..29: 5, 6 are rework, 7, 8 productive; a final save of
             step 8 blocking 1 s, the end event at t=30.5.
    """
    def phase(name, at, logged):   # phases are logged at the first step
        return {"event": "phase", "phase": name, "at": at, "time": logged}

    events = [{"event": "start", "step": 0, "time": 5.0}]
    events += [phase("process_started", 0.0, 6.0), phase("imports_done", 2.0, 6.0),
               phase("rendezvous_done", 3.0, 6.0), phase("model_built", 4.0, 6.0),
               phase("checkpoint_chosen", 4.5, 6.0), phase("loaded", 5.0, 6.0),
               phase("first_step", 6.0, 6.0)]
    events.insert(1, {"event": "step", "step": 1, "time": 6.0})
    events += [{"event": "step", "step": s, "time": 5.0 + s} for s in range(2, 7)]
    events += [{"event": "save", "step": 3, "blocking_s": 0.25, "waited_s": 0.25,
                "time": 9.5},
               {"event": "eval", "step": 5, "eval_time_s": 0.5, "time": 10.9}]
    events += [{"event": "start", "step": 3, "time": 24.0}]
    events += [phase("workers_stopped", 14.0, 25.0), phase("process_started", 20.0, 25.0),
               phase("imports_done", 21.0, 25.0), phase("rendezvous_done", 22.0, 25.0),
               phase("model_built", 23.0, 25.0), phase("checkpoint_chosen", 23.5, 25.0),
               phase("loaded", 24.0, 25.0), phase("first_step", 25.0, 25.0)]
    events.insert(-8, {"event": "step", "step": 4, "time": 25.0})
    events += [{"event": "step", "step": s, "time": 21.0 + s} for s in range(5, 9)]
    events += [{"event": "save", "step": 8, "blocking_s": 1.0, "time": 30.0},
               {"event": "end", "status": 0, "time": 30.5}]
    records = [{"format": 1, "id": "a", "started_at": 0.0, "resumed_step": 0},
               {"format": 1, "id": "b", "started_at": 20.0, "resumed_step": 3,
                "first_step_at": 25.0,
                "previous": {"kind": "rank_lost", "step": 5, "durable_step": 3,
                             "steps_lost": 2, "ended_at": 10.0},
                }]
    return records, events


def test_the_ledger_of_a_synthetic_run_has_the_known_parts():
    ledger = accounts.account(*synthetic_run())
    assert ledger.wall_s == pytest.approx(30.5)
    parts = ledger.parts_s
    assert parts["saving"] == pytest.approx(0.5 + 1.0)
    assert parts["eval"] == pytest.approx(0.5)
    # start 1: steps 2..6, 5 s minus 0.5 saving and 0.5 eval; start 2: steps 7, 8
    assert parts["productive"] == pytest.approx(4.0 + 2.0)
    assert parts["rework"] == pytest.approx(2.0)                  # steps 5 and 6 again
    phases = ledger.restart_phases_s
    assert phases == pytest.approx({"detection": 3.0, "queue": 6.0, "imports": 3.0,
                                    "rendezvous": 2.0, "build": 2.0, "load": 2.0,
                                    "first_step": 2.0})
    assert parts["restart"] == pytest.approx(20.0)
    assert parts["unaccounted"] == pytest.approx(0.5)             # the end after the save
    assert sum(parts.values()) == pytest.approx(ledger.wall_s)
    [item] = ledger.interruptions
    # its events say it reached step 6 at t=11, more than its record knew
    assert (item["kind"], item["step"], item["steps_lost"]) == ("rank_lost", 6, 3)
    assert item["time"] == pytest.approx(11.0) and item["downtime_s"] == pytest.approx(14.0)
    assert ledger.exposure_s == pytest.approx(11.0 + 10.5)


def test_the_ledger_from_the_history_alone_is_coarser_but_adds_up():
    records, _ = synthetic_run()
    records[0].update(first_step_at=6.0, last_step=6, last_seen=11.0)
    records[1].update(last_step=8, end={"kind": "finished", "time": 30.5, "step": 8})
    ledger = accounts.account(records, [])
    assert ledger.coarse and ledger.wall_s == pytest.approx(30.5)
    assert sum(ledger.parts_s.values()) == pytest.approx(ledger.wall_s)
    # start 2: 5.5 s of training over 4 steps after its first, 2 of them redone
    assert ledger.parts_s["rework"] == pytest.approx(5.5 / 4 * 2)
    assert [i["kind"] for i in ledger.interruptions] == ["rank_lost"]


# --------------------------------------------------------------- the history --
WRITER = """
import sys, time
sys.path.insert(0, {src!r})
from {package}.checkpoint.store.storage import LocalStorage
from {package}.ledger.history import HistorySink
from {package}.runtime.metrics import Event
sink = HistorySink(LocalStorage({root!r}), 75, None)
sink.log(Event.start, dict(step=0, restart=0, world_size=1))
print("started", flush=True)
step = 0
while True:
    step += 1
    sink.log(Event.save, dict(step=step))   # a rewrite of the record each time
"""


def test_the_history_survives_kill_9_and_skips_a_torn_record(tmp_path):
    root = tmp_path / "ckpt"
    package = project_module("checkpoint").__name__.split(".")[0]
    script = WRITER.format(src=str(ROOT / "src"), package=package, root=str(root))
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", script], env=suite_env(),
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    (root / history.HISTORY_DIR / "start-000000000000001-torn.json").write_text('{"forma')
    records, skipped = history.read_history(storage_mod.LocalStorage(root))
    assert len(records) == 5 and skipped == 1
    assert all(r["format"] == history.FORMAT and r["saves"] for r in records)
    # keep_last retires step_* only: the history is not among what it may remove
    layout = project_module("checkpoint.store.layout")
    assert layout.list_committed(storage_mod.LocalStorage(root), warn=False) == []


def test_the_history_on_an_object_store_and_the_previous_end(tmp_path):
    store = storage_mod.open_storage(f"memory://history-{os.getpid()}/run")
    first = history.HistorySink(store, 75, None)
    first.log(Event.start, {"step": 0, "restart": 0, "world_size": 2})
    first.log(Event.step, {"step": 7})
    first.log(Event.end, {"status": 75, "reason": "preempted"})
    first.close()
    second = history.HistorySink(store, 75, None)
    second.log(Event.start, {"step": 5, "restart": 0, "world_size": 2})
    second.close()
    records, skipped = history.read_history(store)
    assert skipped == 0 and {r["id"] for r in records} == {first.record["id"],
                                                           second.record["id"]}
    records.sort(key=lambda r: r["id"] != first.record["id"])   # the same process start
    previous = records[1]["previous"]
    assert (previous["kind"], previous["step"], previous["durable_step"],
            previous["steps_lost"]) == ("preempted_notice", 7, 5, 2)
    # killed without a word: what its ranks' exit records say wins over no end at all
    third = history.previous_end({"started_at": 1.0, "last_step": 9}, {
        "kind": "lost", "summary": "rank 1 ended without a word", "step": 11}, 8, 75)
    assert (third["kind"], third["step"], third["steps_lost"]) == ("rank_lost", 11, 3)
    assert history.previous_end({"started_at": 1.0}, None, 0, 75)["kind"] == \
        "preempted_no_notice"
    assert json.loads(json.dumps(records))   # plain JSON, as documented
    assert math.isfinite(records[0]["started_at"])


# ------------------------------------------------------- the plan and resume --
def write_history(root, count: int, hours: float, kind: str = "preempted_notice") -> None:
    """``count`` interruptions spread over ``hours`` of training, then a running start."""
    folder = root / history.HISTORY_DIR
    folder.mkdir(parents=True)
    span = hours * 3600 / (count + 1)
    for k in range(count + 1):
        begin = 1.7e9 + k * span
        record = {"format": history.FORMAT, "id": f"{k:08d}", "started_at": begin,
                  "first_step_at": begin + 60, "resumed_step": 100 * k,
                  "last_step": 100 * k + 90, "last_seen": begin + span - 120, "restart": 0}
        if k:
            record["previous"] = {"kind": kind, "step": 100 * k - 10, "durable_step": 100 * k,
                                  "steps_lost": 0, "ended_at": begin - 120}
        name = history.record_name(begin, record["id"]).split("/")[-1]
        (folder / name).write_text(json.dumps(record))


def test_plan_from_history_and_the_unasked_notice(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_history(ckpt, 9, 17.0)
    args = [f"checkpoint.dir={ckpt}", f"log.dir={tmp_path / 'logs'}", "plan.mtbi_hours=8"]
    proc = run_module("plan", "--json", "--from-history", *args)
    planned = json.loads(proc.stdout)
    assert planned["inputs"]["mtbi_hours"] == pytest.approx(17.0 * 0.98 / 9, rel=0.05)
    assert planned["inputs"]["crash_share"] == 0.0
    assert "from the history, measured MTBI" in proc.stderr
    notice = run_module("plan", *args).stderr
    assert "notice: measured MTBI" in notice and "from 9 interruptions" in notice
    assert "configured 8 h" in notice and "--from-history" in notice
    assert "notice: measured MTBI" in run_module("resume", "--dry-run", *args).stderr
    # an MTBI the interval holds: nothing said
    assert "notice:" not in run_module("plan", *args[:2], "plan.mtbi_hours=2").stderr
    few = tmp_path / "few"
    write_history(few, 2, 1.0)
    refused = run_module("plan", "--from-history", f"checkpoint.dir={few}", check=False)
    assert refused.returncode == 2 and "too few to plan with" in refused.stderr
    assert "Traceback" not in refused.stderr


# English, and Chinese in a render whose docs_language is zh.
@pytest.mark.parametrize("lang", sorted(project_module("ledger.report").TEXT))
def test_the_checklists_measured_section_shows_the_ledger(tmp_path, lang):
    title = {"en": "Where the time went", "zh": "时间花在哪里"}[lang]
    from test_plan import write_metrics

    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    write_history(ckpt, 4, 2.0, kind="rank_lost")
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    checklist = tmp_path / "CHECKLIST.md"
    checklist.write_text(f"# C\n\n<!-- measured:begin lang={lang} -->\nold\n"
                         "<!-- measured:end -->\n", encoding="utf-8")
    run_module("plan", "--metrics", str(metrics), "--write", str(checklist),
               f"checkpoint.dir={ckpt}", f"log.dir={logs}")
    text = checklist.read_text(encoding="utf-8")
    assert title in text and "rank_lost" in text and "old" not in text
    assert text.count("rank_lost") == 4
    assert ("from 4 interruption(s)" if lang == "en" else "4 次中断") in text
