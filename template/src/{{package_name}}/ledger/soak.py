"""The soak: train under a seeded stream of faults and hold the plan against what happened.

    python -m <package>.soak [--mtbi-seconds S] [--minutes M] [--seed N] [--ranks R]
                             [--intervals 0.5,1,2] [--out DIR] [--json] [key=value ...]

Calibrate, train a reference, train again under faults at each ``--intervals`` multiple of
the planned interval; each run's state must be bit-identical to the reference's and its
badput within tolerance of the prediction (docs/GOODPUT.md, "The soak").

Exit status: 0 every state exact and every measured badput within its tolerance; 1 not;
2 bad arguments or configuration (nothing ran).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import PACKAGE
from ..config import ConfigError, load_config
from ..interval.formulas import recommended_interval_steps
from ..interval.inputs import Inputs, MetricsError, read_metrics
from ..runtime import exit_codes
from ..runtime.exit_codes import Refused, refusals
from ..runtime.output_dirs import make_output_dir
from .soak_run import FAULT_KINDS, Fault, SoakRunError, run_with_faults, start_job, wait_job

SMALL = ["model.d_model=32", "model.n_layers=1", "eval.at_end=false", "eval.every_steps=0",
         "log.every_steps=1000000", "checkpoint.keep_last=2", "loader.num_workers=0"]
CALIBRATION_STEPS = 60
# A run trains at least this many MTBIs: sized to what a slow calibration left of --minutes,
# runs ended before any fault reached their steps (0 interruptions to judge the plan by).
MIN_TRAINING_MTBIS = 2.0
TIMER_FLOOR_PERCENT = 1.0


@dataclass
class Soak:
    args: argparse.Namespace
    out: Path
    base: list[str]                  # overrides every run gets
    step_s: float = 0.0
    blocking_s: float = 0.0
    latency_s: float = 0.0
    interval_steps: int = 0
    max_steps: int = 0
    faults: list[Fault] = field(default_factory=list)

    def overrides(self, name: str, *extra: str) -> list[str]:
        return [*self.base, f"checkpoint.dir={self.out / name / 'ckpt'}",
                f"log.dir={self.out / name / 'logs'}", *extra]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.soak",
        description="Train under a seeded Poisson stream of faults at a scaled-down MTBI "
                    "and check the state and the plan's badput against reality.",
        epilog="Exit status: 0 exact and within tolerance; 1 not; 2 refused.")
    parser.add_argument("--mtbi-seconds", type=float, default=45.0, metavar="S",
                        help="mean time between faults (default 45)")
    parser.add_argument("--minutes", type=float, default=3.0, metavar="M",
                        help="about how long the soak runs in all (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="the fault stream's seed")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of every run (default 2)")
    parser.add_argument("--intervals", default="1", metavar="M1,M2,...",
                        help="multiples of the planned interval to run under the same "
                             "faults, e.g. 0.5,1,2 (default 1)")
    parser.add_argument("--out", type=Path, default=Path("soak"), help="output folder")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--config", default=None)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    for name in ("mtbi_seconds", "minutes"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            parser.error(f"argument --{name.replace('_', '-')}: must be a number > 0")
    if args.ranks < 1:
        parser.error("argument --ranks: must be >= 1")
    try:
        args.multipliers = [float(m) for m in args.intervals.split(",")]
    except ValueError:
        parser.error(f"argument --intervals: numbers separated by commas (got {args.intervals!r})")
    if not all(m > 0 and math.isfinite(m) for m in args.multipliers):
        parser.error("argument --intervals: every multiple must be > 0")
    return args


def fault_times(seed: int, mtbi_s: float, horizon_s: float) -> list[Fault]:
    """The seeded Poisson stream: times from a run's start, each with its kind."""
    rng = random.Random(seed)
    faults, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbi_s)
        if t > horizon_s:
            return faults
        faults.append(Fault(t, rng.choice(FAULT_KINDS)))


def calibrate(soak: Soak) -> None:
    """T, δ and L from a short run; the plan's interval; the steps of every run, sized so
    that the whole soak takes about --minutes."""
    name = "calibration"
    shutil.rmtree(soak.out / name, ignore_errors=True)
    began = time.monotonic()
    proc = start_job(soak.args.ranks, soak.overrides(
        name, f"train.max_steps={CALIBRATION_STEPS}", "checkpoint.interval_steps=10"),
        soak.out / name / "job.log")
    status = wait_job(proc, 600)
    if status != 0:
        raise SoakRunError(f"the calibration run exited {status} (see {soak.out / name}/job.log)")
    spent = time.monotonic() - began
    measured = read_metrics(soak.out / name / "logs")
    soak.step_s, soak.blocking_s = measured.step_seconds, measured.blocking_seconds
    soak.latency_s = measured.commit_latency_seconds
    inputs = Inputs(mtbi_hours=soak.args.mtbi_seconds / 3600, step_seconds=soak.step_s,
                    blocking_seconds=soak.blocking_s, commit_latency_seconds=soak.latency_s,
                    restart_seconds=0.0, badput_target_percent=50.0)
    soak.interval_steps = recommended_interval_steps(inputs)
    # A faulty run lasts about its training time / (1 - R/M): every M seconds a restart
    # of about R (a start of this calibration, a little more for the faults' cleanup).
    startup = max(spent - CALIBRATION_STEPS * soak.step_s, 1.0)
    stretch = 1.0 / (1.0 - min(startup / soak.args.mtbi_seconds, 0.6))
    budget = max(soak.args.minutes * 60 - spent, 30.0)
    training_s = max(budget / (1 + stretch * len(soak.args.multipliers)) - startup,
                     MIN_TRAINING_MTBIS * soak.args.mtbi_seconds)
    soak.max_steps = max(int(training_s / soak.step_s), 4 * soak.interval_steps, 20)
    horizon = soak.args.minutes * 60 * 4       # more than any run lasts
    soak.faults = fault_times(soak.args.seed, soak.args.mtbi_seconds, horizon)


def final_state(ckpt: Path, step: int) -> dict[str, Any]:
    """The model and optimizer tensors of the checkpoint of ``step``, flat."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        target = os.path.join(scratch, "state.pt")
        dcp_to_torch_save(str(ckpt / f"step_{step:09d}"), target)
        state = torch.load(target, weights_only=False)   # the soak's own checkpoint
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", state.get("app", {}))   # the model and the optimizer (checkpoint/state.py)
    return flat


def same_state(reference: dict[str, Any], other: dict[str, Any]) -> tuple[bool, str]:
    import torch

    if reference.keys() != other.keys():
        return False, f"different entries: {sorted(reference.keys() ^ other.keys())[:5]}"
    if not reference:
        return False, "no model or optimizer tensors found in the checkpoint"
    differ = [k for k in reference if not torch.equal(reference[k], other[k])]
    if differ:
        return False, f"{len(differ)} of {len(reference)} tensors differ, e.g. {differ[0]}"
    return True, f"{len(reference)} tensors bit-identical"


def predict(interval_steps: int, ledger, events: list[dict[str, Any]],
            logs: Path) -> dict[str, Any]:
    """The plan's badput for this run from its own T, δ, L and interruptions; what the model
    takes as given (restarts, saves other than interval saves) as measured. Interval saves
    count at their mean stall, not the median δ: one queued behind a slow commit counts."""
    inputs = read_metrics(logs)
    tau = interval_steps * inputs.step_seconds
    d, latency = inputs.blocking_seconds, inputs.commit_latency_seconds
    parts, wall = ledger.parts_s, ledger.wall_s
    training = parts["productive"] + parts["rework"]
    lossy = sum(i["kind"] != "preempted_notice" for i in ledger.interruptions)
    interval_saves, other_saves = [], 0.0   # each save's stall and its wait
    for e in (e for e in events if e["event"] == "save"):
        cost = float(e.get("blocking_s") or 0) + float(e.get("waited_s") or 0)
        if e.get("reason") == "interval":
            interval_saves.append(cost)
        else:
            other_saves += cost
    mean_stall = sum(interval_saves) / len(interval_saves) if interval_saves else d
    other_saves += sum(float(e.get("waited_s") or 0) for e in events if e["event"] == "phase"
                       and e.get("phase") == "checkpoint_process_ready")
    predicted = {"saving": training * mean_stall / tau + other_saves,
                 "rework": lossy * ((tau + d) / 2 + latency),
                 "restart": parts["restart"], "eval": parts["eval"],
                 "unaccounted": parts["unaccounted"]}
    sigma = (tau + d) * math.sqrt(lossy / 12.0)
    return {
        "interval_steps": interval_steps,
        "wall_s": wall,
        "measured_badput_percent": ledger.badput_percent,
        "predicted_badput_percent": 100 * sum(predicted.values()) / wall,
        "tolerance_percent": 100 * 3 * sigma / wall + TIMER_FLOOR_PERCENT,
        "measured_percent": {k: 100 * v / wall for k, v in parts.items() if k != "productive"},
        "predicted_percent": {k: 100 * v / wall for k, v in predicted.items()},
        "inputs": {"step_s": inputs.step_seconds, "blocking_s": d, "latency_s": latency,
                   "mean_interval_save_s": mean_stall},
        "interruptions": len(ledger.interruptions),
        "losing_work": lossy,
        "kinds": sorted({i["kind"] for i in ledger.interruptions}),
    }


def run_soak(soak: Soak) -> dict[str, Any]:
    from ..checkpoint import open_storage
    from ..runtime.metrics import read_events
    from .accounts import account
    from .history import read_history

    calibrate(soak)
    steps = f"train.max_steps={soak.max_steps}"
    shutil.rmtree(soak.out / "reference", ignore_errors=True)
    reference = start_job(soak.args.ranks, soak.overrides(
        "reference", steps, f"checkpoint.interval_steps={soak.interval_steps}"),
        soak.out / "reference" / "job.log")
    if wait_job(reference, soak.args.minutes * 60 * 2) != 0:
        raise SoakRunError(f"the reference run failed (see {soak.out}/reference/job.log)")
    expected = final_state(soak.out / "reference" / "ckpt", soak.max_steps)
    runs = []
    for multiplier in soak.args.multipliers:
        interval = max(round(multiplier * soak.interval_steps), 1)
        name = f"interval-{interval}"
        shutil.rmtree(soak.out / name, ignore_errors=True)
        laid = run_with_faults(soak.args.ranks, soak.overrides(
            name, steps, f"checkpoint.interval_steps={interval}"), soak.out / name / "job.log",
            soak.faults, soak.args.seed, deadline_s=soak.args.minutes * 60 * 3)
        exact, how = same_state(expected, final_state(soak.out / name / "ckpt", soak.max_steps))
        records, _ = read_history(open_storage(str(soak.out / name / "ckpt")))
        events = read_events(soak.out / name / "logs")[0]
        run = predict(interval, account(records, events), events, soak.out / name / "logs")
        run.update(multiplier=multiplier, exact=exact, state=how, faults=laid,
                   within=abs(run["measured_badput_percent"] - run["predicted_badput_percent"])
                   <= run["tolerance_percent"])
        runs.append(run)
    planned = next((r for r in runs if r["multiplier"] == 1.0), runs[0])
    lowest = min(runs, key=lambda r: r["measured_badput_percent"])
    return {
        "exact": all(r["exact"] for r in runs),
        "interruptions": planned["interruptions"],
        "tolerance_percent": planned["tolerance_percent"],
        "planned_interval_steps": soak.interval_steps,
        "lowest_at_planned": lowest is planned if len(runs) > 1 else None,
        "mtbi_seconds": soak.args.mtbi_seconds, "seed": soak.args.seed,
        "ranks": soak.args.ranks, "max_steps": soak.max_steps,
        "step_s": soak.step_s, "blocking_s": soak.blocking_s, "latency_s": soak.latency_s,
        "faults": [{"at_s": f.at_s, "kind": f.kind} for f in soak.faults
                   if f.at_s <= max(r["wall_s"] for r in runs)],
        "runs": runs,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [(f"soak: {report['ranks']} rank(s), {report['max_steps']} steps, faults every "
              f"{report['mtbi_seconds']:g} s on average (seed {report['seed']}); T "
              f"{report['step_s']:.3f} s, δ {report['blocking_s']:.3f} s, L "
              f"{report['latency_s']:.3f} s; planned interval "
              f"{report['planned_interval_steps']} steps")]
    for run in report["runs"]:
        lines.append(
            f"interval {run['interval_steps']} ({run['multiplier']:g}x): "
            f"{run['interruptions']} interruption(s) ({run['losing_work']} losing work), "
            f"measured badput {run['measured_badput_percent']:.1f} %, predicted "
            f"{run['predicted_badput_percent']:.1f} % ± {run['tolerance_percent']:.1f}: "
            f"{'within' if run['within'] else 'OUTSIDE'}; state "
            f"{'exact' if run['exact'] else 'DIFFERENT'} ({run['state']})")
        lines.append("   component     measured  predicted")
        for part, value in run["predicted_percent"].items():
            lines.append(f"   {part:<12} {run['measured_percent'][part]:8.2f} %  {value:7.2f} %")
    if report["lowest_at_planned"] is not None:
        lines.append("the planned interval had the lowest measured badput" if
                     report["lowest_at_planned"] else
                     "the planned interval did NOT have the lowest measured badput (the curve "
                     "is flat near its minimum: more interruptions tell them apart)")
    return "\n".join(lines)


@refusals
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        load_config(args.config, args.overrides)   # refused here, before anything runs
    except ConfigError as exc:
        raise Refused(exc) from exc
    out = args.out.resolve()
    make_output_dir(out)
    base = [*SMALL, *(["--config", args.config] if args.config else []), *args.overrides]
    soak = Soak(args, out, base)
    try:
        report = run_soak(soak)
    except (SoakRunError, MetricsError, OSError) as exc:
        print(f"soak: failed: {exc}", file=sys.stderr)
        return exit_codes.FAILED
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(json.dumps(report) if args.json else format_report(report))
    ok = report["exact"] and all(r["within"] for r in report["runs"])
    return exit_codes.OK if ok else exit_codes.FAILED
