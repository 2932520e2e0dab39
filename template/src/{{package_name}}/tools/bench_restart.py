"""``bench --restart``: how long a restart takes, phase by phase, on this configuration.

    python -m <package>.bench --restart [--repeats 5] [--nproc N] [--json] [key=value ...]

Each repeat runs the project's ``resume`` in a scratch directory, warm and cold in turn,
and times a stopped job resumed (launch to first step) and a worker killed with SIGKILL
past a commit (kill to the first new step); medians and phases: docs/RECOVERY.md, "Where
the seconds of a restart go". Exit status 0, 1 a start did not reach its first step in
time (the scratch logs say why), 2 bad input.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import PACKAGE
from ..config import Config
from ..recovery.attempts import read_records
from ..runtime import exit_codes
from ..runtime.exit_codes import Refused
from ..runtime.metrics import Event, read_events
from ..runtime.output_dirs import make_output_dir
from ..runtime.phases import ORDER, Phase
from .bench_report import fmt

START_TIMEOUT_S = 300.0   # a start that has not trained a step by then failed
STOP_TIMEOUT_S = 120.0    # a stopped job that has not exited by then is killed
INTERVAL_STEPS = 10       # unless given: a checkpoint to resume from within seconds


class RestartFailed(RuntimeError):
    """A start did not reach its first step in time; the message says where to look."""


MODES = ("warm", "cold")   # recovery.warm_start=true, then false, in each repeat


def run(cfg: Config, overrides: list[str], *, repeats: int, nproc: int, scratch: Path,
        say=print) -> dict[str, Any]:
    """``repeats`` stopped-job resumes and worker kills, warm and cold in turn, with their
    medians and phases' medians; the warm figures keep the report's top-level keys."""
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        mode: {"resumes": [], "kills": []} for mode in MODES}
    for cycle in range(repeats + 1):   # the first trains from nothing: not a resume
        for mode in MODES:
            resume, kill = _cycle(overrides, nproc, scratch / mode, cycle, warm=mode == "warm")
            if resume is not None:
                samples[mode]["resumes"].append(resume)
            if len(samples[mode]["kills"]) < repeats:
                samples[mode]["kills"].append(kill)
            say(f"  {mode} {'start' if resume is None else f'repeat {cycle}'}: "
                + (f"stopped job -> first step {resume['seconds']:.2f} s, " if resume
                   else "from nothing, ")
                + f"worker killed -> first new step {kill['seconds']:.2f} s")
    report = {"nproc": nproc, "repeats": repeats,
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()],
              **_summary(samples["warm"])}
    report["cold"] = _summary(samples["cold"])
    report["warm_over_cold"] = {
        key: _ratio(report[key], report["cold"][key])
        for key in ("stopped_job_to_first_step_s", "worker_death_to_first_step_s")}
    return report


def _cycle(overrides: list[str], nproc: int, scratch: Path, cycle: int, *,
           warm: bool) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """One job launched on the last cycle's checkpoints, a worker killed past a commit,
    stopped: the resume's figure (None on cycle 0, which starts from nothing), the kill's."""
    ckpt, logs = scratch / "checkpoints", scratch / "logs"
    # A checkpoint soon and no trackers, unless overridden; scratch dirs and no end are ours.
    args = [f"checkpoint.interval_steps={INTERVAL_STEPS}", "log.trackers=[]", *overrides,
            f"recovery.warm_start={str(warm).lower()}",
            f"checkpoint.dir={ckpt}", f"log.dir={logs}", "train.max_steps=100000000"]
    launched = time.time()
    proc = _launch(nproc, args, scratch / f"resume-{cycle}.log")
    try:
        first = _phases_after(logs, launched, restart=0, proc=proc)
        _wait_for_a_checkpoint(ckpt, after=launched, proc=proc)
        pid = _worker_pid(logs, 1 if nproc > 1 else 0, launched)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        second = _phases_after(logs, killed, restart=None, proc=proc)
    finally:
        _stop(proc)
    return (_figure(first, launched, "launched") if cycle > 0 else None,
            _figure(second, killed, "killed"))


def _summary(sampled: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    resumes, kills = sampled["resumes"], sampled["kills"]
    return {
        "stopped_job_to_first_step_s": _median([r["seconds"] for r in resumes]),
        "worker_death_to_first_step_s": _median([k["seconds"] for k in kills]),
        "stopped_job_phases_s": _median_phases(resumes),
        "worker_death_phases_s": _median_phases(kills),
        "samples": {"stopped_job": [round(r["seconds"], 3) for r in resumes],
                    "worker_death": [round(k["seconds"], 3) for k in kills]},
    }


def _ratio(warm: float | None, cold: float | None) -> float | None:
    return round(warm / cold, 3) if warm is not None and cold else None


def text(report: dict[str, Any]) -> str:
    cold, ratio = report["cold"], report["warm_over_cold"]
    lines = [(f"restart figures, median of {report['repeats']} ({report['nproc']} rank(s); "
              f"load average {report['load_average_before'][0]:.2f} before, "
              f"{report['load_average_after'][0]:.2f} after):"),
             f"  {'':<44} {'warm':>7} {'cold':>7} {'warm/cold':>9}"]
    for title, key in (("stopped job: resume launched -> first step",
                        "stopped_job_to_first_step_s"),
                       ("worker killed -> first new step", "worker_death_to_first_step_s")):
        lines.append(f"  {title:<44} {fmt(report[key], '.2f'):>7} {fmt(cold[key], '.2f'):>7} "
                     f"{fmt(ratio[key], '.2f'):>9}")
    for title, key in (("stopped job", "stopped_job_phases_s"),
                       ("worker killed", "worker_death_phases_s")):
        lines.append(f"phases after '{title}' (median seconds each took):   warm    cold")
        lines += [f"  {name:<40} {fmt(report[key].get(name), '.2f'):>7} "
                  f"{fmt(cold[key].get(name), '.2f'):>7}"
                  for name in dict.fromkeys([*report[key], *cold[key]])]
    return "\n".join(lines)


def _launch(nproc: int, args: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", f"{PACKAGE}.resume",
                                 "--nproc-per-node", str(nproc), *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _phases_after(logs: Path, since: float, restart: int | None,
                  proc: subprocess.Popen) -> list[dict[str, Any]]:
    """The phase events of the first start after ``since`` that reached its first step."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        events, _ = read_events(logs, Event.phase, since=since)
        done = [e for e in events if e["phase"] == Phase.first_step.value
                and (restart is None or e.get("restart") == restart)]
        if done:
            return [e for e in events if e.get("step") == done[0]["step"]
                    and e.get("restart") == done[0].get("restart")]
        if proc.poll() is not None:
            raise RestartFailed(f"resume exited with status {proc.returncode} before its "
                                f"first step (see {logs})")
        time.sleep(0.05)
    raise RestartFailed(f"no first step within {START_TIMEOUT_S:g} s (see {logs})")


def _wait_for_a_checkpoint(ckpt: Path, after: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.stat().st_mtime >= after for p in ckpt.glob("step_*/commit.json")):
            return
        if proc.poll() is not None:
            raise RestartFailed(f"resume exited with status {proc.returncode} before its "
                                f"first checkpoint (see {ckpt})")
        time.sleep(0.05)
    raise RestartFailed(f"no checkpoint committed within {START_TIMEOUT_S:g} s")


def _worker_pid(logs: Path, rank: int, since: float) -> int:
    for record in read_records(logs):
        if (record.get("rank") == rank and record.get("state") == "running"
                and record.get("started", 0) >= since - 1):
            return int(record["pid"])
    raise RestartFailed(f"no running worker of rank {rank} in {logs}")


def _stop(proc: subprocess.Popen) -> None:
    """End the job as a preemption does (SIGTERM); kill what is left after a bound."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _figure(events: list[dict[str, Any]], began: float, origin: str) -> dict[str, Any]:
    """Seconds from ``began`` to the first step, and each phase's (the first from ``began``)."""
    rows = sorted(events, key=lambda e: ORDER.index(Phase(e["phase"])))
    phases, before = {}, began
    for row in rows:
        if row["at"] >= began - 0.5:   # not the failure's own records, before the kill
            phases[row["phase"]] = row["at"] - before
            before = row["at"]
    first = next(e["at"] for e in rows if e["phase"] == Phase.first_step.value)
    named = {f"{origin} -> " + k if i == 0 else k: v for i, (k, v) in enumerate(phases.items())}
    return {"seconds": first - began, "phases": named}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _median_phases(figures: list[dict[str, Any]]) -> dict[str, float | None]:
    names = dict.fromkeys(n for figure in figures for n in figure["phases"])
    return {name: _median([f["phases"][name] for f in figures if name in f["phases"]])
            for name in names}


def main(cfg: Config, overrides: list[str], *, repeats: int, nproc: int, as_json: bool,
         directory: str | None) -> int:
    if "WORLD_SIZE" in os.environ:   # bench's main says it (exit_codes.refusals)
        raise Refused("bench --restart launches its own jobs: run it with python -m "
                      f"{PACKAGE}.bench --restart, not under torchrun")
    scratch = (make_output_dir(directory) if directory   # a new one ignores itself in git
               else Path(tempfile.mkdtemp(prefix="bench-restart-")))
    say = (lambda *a, **k: None) if as_json else print
    say(f"restart benchmark: {repeats} repeat(s) on {nproc} rank(s), scratch {scratch}")
    try:
        report = run(cfg, overrides, repeats=repeats, nproc=nproc, scratch=scratch, say=say)
    except RestartFailed as exc:
        raise Refused(exc, exit_codes.FAILED) from exc
    if directory is None:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(report) if as_json else text(report))
    return exit_codes.OK
