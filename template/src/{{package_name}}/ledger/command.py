"""The goodput ledger on the command line.

    python -m <package>.goodput [--config PATH] [--json] [--plot FILE] [key=value ...]

Prints where the time of every start went, the interruptions, the measured MTBI and the
measured badput beside the plan's (docs/GOODPUT.md, "The ledger"); with ``log.dir`` gone,
from the interruption history alone.

Exit status: 0 the ledger was printed; 2 a bad configuration, or nothing recorded yet;
73 ``checkpoint.dir`` cannot be reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from .. import PACKAGE
from ..checkpoint.store.outage import ends_storage_errors
from ..config import Config, ConfigError, load_config
from ..interval.formulas import badput, badput_components
from ..interval.plot import PLOT_SUFFIXES, PlotUnavailable
from ..runtime import exit_codes
from ..runtime.exit_codes import Refused, refusals
from .accounts import PARTS, RESTART_PHASES, Ledger
from .advice import measured, planned_inputs, run_ledger
from .mtbi import MIN_COUNT, describe, duration, measure_mtbi


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.goodput",
        description="Where the machine time of a run went: productive steps, rework, "
                    "saving, evaluation and restarts, over every start; the measured MTBI "
                    "and the measured badput next to the plan's.",
        epilog="Exit status: 0 printed; 2 bad configuration or nothing recorded; 73 "
               "checkpoint.dir cannot be reached.")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="draw the timeline of every start (.png or .svg)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        parser.error(f"argument --plot: the file name must end in .png or .svg (got {args.plot})")
    return args


def summarize(ledger: Ledger, cfg: Config, skipped: int = 0,
              has_metrics: bool = True) -> dict[str, Any]:
    """The ledger of ``cfg``'s run summed up: what --json prints."""
    found = measured(ledger)
    inputs = planned_inputs(cfg, has_metrics)
    tau = cfg.checkpoint.interval_steps * inputs.step_seconds
    predicted = {k: 100 * v for k, v in badput_components(tau, inputs).items()}
    return {
        "wall_s": ledger.wall_s,
        "parts_s": ledger.parts_s,
        "restart_phases_s": ledger.restart_phases_s,
        "badput_percent": ledger.badput_percent,
        "planned_badput_percent": 100 * badput(tau, inputs),
        "planned_components_percent": predicted,
        "interval_steps": cfg.checkpoint.interval_steps,
        "planned_mtbi_hours": cfg.plan.mtbi_hours / cfg.plan.nodes,
        "planned_inputs": dataclasses.asdict(inputs),
        "interruptions": ledger.interruptions,
        "mtbi": dataclasses.asdict(found.mtbi),
        "crash_share": dataclasses.asdict(found.crash_share),
        "node_loss_share": dataclasses.asdict(found.node_loss_share),
        "restart_s": found.restart_s,
        "in_place_restart_s": found.in_place_restart_s,
        "starts": len(ledger.starts),
        "coarse": ledger.coarse,
        "skipped_records": skipped,
    }


def format_ledger(result: dict[str, Any]) -> str:
    wall = result["wall_s"]
    lines = [f"goodput ledger: {result['starts']} start(s), {duration(wall)} of wall time"
             + (" (from the history alone: saving and eval are inside training)"
                if result["coarse"] else "")]
    for part in PARTS:
        seconds = result["parts_s"][part]
        lines.append(f"  {part:<12} {seconds:10.1f} s  "
                     f"{100 * seconds / wall if wall else 0:5.1f} %")
        if part == "restart":
            lines += [f"    {phase:<12} {result['restart_phases_s'][phase]:8.1f} s"
                      for phase in RESTART_PHASES if result["restart_phases_s"][phase] > 0]
    lines.append(f"measured badput {result['badput_percent']:.2f} %; the plan expects "
                 f"{result['planned_badput_percent']:.2f} % at checkpoint.interval_steps="
                 f"{result['interval_steps']} with an MTBI of {result['planned_mtbi_hours']:g} h")
    mtbi = measure_mtbi(result["mtbi"]["count"], result["mtbi"]["exposure_s"])
    lines.append(describe(mtbi) + ("" if mtbi.enough else
                                   f" (fewer than {MIN_COUNT}: too few to plan with)"))
    crash = result["crash_share"]
    if crash["estimate"] is not None:
        lines.append(f"crash share {crash['estimate']:.2f} ({crash['count']} of "
                     f"{mtbi.count}); node-loss share {result['node_loss_share']['estimate']:.2f}")
    for item in result["interruptions"]:
        down = "" if item["downtime_s"] is None else f", back {item['downtime_s']:.1f} s later"
        lines.append(f"  {item['kind']} at step {item['step']}: {item['steps_lost']} step(s) "
                     f"lost{down}")
    if result["skipped_records"]:
        lines.append(f"({result['skipped_records']} unreadable history record(s) skipped)")
    return "\n".join(lines)


@refusals
@ends_storage_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        ledger, skipped, has_metrics = run_ledger(cfg)
        result = summarize(ledger, cfg, skipped, has_metrics=has_metrics)
    except (ConfigError, LookupError, ValueError) as exc:
        raise Refused(exc) from exc
    print(json.dumps(result) if args.json else format_ledger(result))
    if args.plot:
        from .plot import plot_timeline

        try:
            plot_timeline(ledger, args.plot)
        except PlotUnavailable as exc:
            print(f"goodput: {exc}", file=sys.stderr)
            return exit_codes.FAILED
        print(f"goodput: wrote {args.plot}", file=sys.stderr)
    return exit_codes.OK

