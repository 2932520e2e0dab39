"""The interruption drill: lose a run the hard way, resume it, and check that nothing changed.

    python -m <package>.drill --save-ranks N --resume-ranks M --out DIR [--steps S]
                              [--interrupt-at K] [--config PATH] [key=value ...]

The command line, its checks and the durable drill's four phases (docs/RESUMING.md, "The
interruption drill"); runs started by drill_runs.py, judged by drill_report.py. Several
nodes (``--save-nodes``, ``--kill node``) and ``--tier memory`` are optional parts
(drill_nodes.py, drill_memory.py), refused naming their copier answer when not rendered.
Exit status: 0 passed, 1 failed, 2 refused (bad arguments; nothing ran).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import time
from importlib import import_module
from pathlib import Path
from types import ModuleType

from .. import PACKAGE
from ..config import ConfigError, load_config, parts
from ..launch.torchrun import positive_int
from ..loop.sampling import BatchSizeError, split_global_batch
from ..loop.task_contract import check_config, load_task
from ..runtime import exit_codes
from ..runtime.exit_codes import Refused, refusals
from ..runtime.metrics import EventTail
from ..runtime.output_dirs import IGNORE_FILE, make_output_dir
from ..runtime.process_tree import kill_tree
from . import drill_report
from .drill_report import DrillError
from .drill_runs import (
    OWNED_KEYS,
    Drill,
    check_devices,
    config_path,
    output_logs,
    run_to_end,
    running,
    say_killed,
    small_model,
    wait_past,
)

DEFAULT_STEPS = 24
# Default interval: the largest divisor of K up to this, so a few checkpoints commit (and
# old ones retire) before the one the run resumes from.
MAX_DEFAULT_INTERVAL = 4
MARKER = ".drill"
# With the memory tier's runs (tools/drill_memory.py, rendered with memory_tier).
OUTPUTS = ("reference", "interrupted", "report.json", "report.md", "loss.png",
           "worker", "node", "job")


def run_and_kill(drill: Drill, commands: list[list[str]], name: str) -> dict:
    """Start the run (a command per node); SIGKILL it all once step K is committed and passed."""
    base = drill.out / name
    logs = output_logs(base, len(commands))
    with running(commands, logs) as procs:
        wait_past(drill, procs, logs, EventTail(base / "logs"), drill.interrupt_at + 1)
        killed_at = time.time()
        killed = sum(kill_tree(proc.pid) for proc in procs)
    return {"killed_at": killed_at, "processes_killed": killed, "node_loss": None}


def run_drill(drill: Drill) -> dict:
    n, m, s, k = drill.save_ranks, drill.resume_ranks, drill.steps, drill.interrupt_at
    drill.say(f"drill: {n} rank(s) save, {m} rank(s) resume; {s} steps, killed after the "
              f"checkpoint of step {k} (checkpoints every {drill.interval}); output in {drill.out}")
    # Several nodes are the multi-node drill's (prepare checked that it is rendered).
    nodes = import_module(".drill_nodes", __package__) if drill.save_nodes > 1 else None
    interrupted = (nodes.commands(drill, "interrupted") if nodes else
                   {"interrupted": drill.train_command("interrupted")})
    drill.commands = {"reference": drill.train_command("reference"), **interrupted,
                      "resume": drill.resume_command()}

    drill.say(f"1/4 reference: {s} uninterrupted steps on {n} rank(s) ...")
    run_to_end(drill, drill.commands["reference"], drill.out / "reference" / "output.log",
               "the reference run")

    if drill.kill == "node":
        kill = nodes.lose_node(drill, list(interrupted.values()), "interrupted")
    else:
        where = f"{n} rank(s)" + (f" on {drill.save_nodes} nodes" if nodes else "")
        drill.say(f"2/4 interrupted run on {where}: SIGKILL the whole job once step {k} is "
                  "committed ...")
        kill = run_and_kill(drill, list(interrupted.values()), "interrupted")
        say_killed(drill, kill)

    drill.say(f"3/4 resume on {m} rank(s) with {PACKAGE}.resume, to step {s} ...")
    run_to_end(drill, drill.commands["resume"], drill.out / "interrupted" / "resume-output.log",
               "the resumed run")

    drill.say("4/4 compare the steps after the resume point with the reference ...")
    return drill_report.build(drill, kill,
                             facts=nodes.markdown_facts if kill["node_loss"] else None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.drill",
        description="Interruption rehearsal: run, kill -9 the whole job after a checkpoint, "
                    "resume on another (or the same) number of ranks, and compare every "
                    "step with an uninterrupted run.",
        epilog="Writes DIR/report.json, DIR/report.md and DIR/loss.png. A re-run into the same DIR "
               f"replaces what an earlier drill wrote there ({', '.join(OUTPUTS)}); a non-empty "
               "DIR that no drill made is refused. Exit status: 0 passed, 1 failed, 2 refused.",
    )
    parser.add_argument("--save-ranks", type=positive_int, required=True, metavar="N",
                        help="ranks of the reference and the interrupted run")
    parser.add_argument("--resume-ranks", type=positive_int, required=True, metavar="M",
                        help="ranks that resume the interrupted run")
    parser.add_argument("--save-nodes", type=positive_int, default=1, metavar="D",
                        help="nodes of the interrupted run, each its own torchrun agent on "
                             "this machine with N/D ranks (default 1)")
    parser.add_argument("--tier", choices=("durable", "memory"), default="durable",
                        help="durable (the default): one loss, resumed from durable storage; "
                             "memory: the memory tier's three losses (a worker, a node, the job), "
                             "each against the uninterrupted run (needs an even N >= 2 and M = N; "
                             "--interrupt-at K is the durable interval, default S/3; memory copies "
                             "every checkpoint.memory_interval_steps, default 1)")
    parser.add_argument("--kill", choices=("job", "node"), default="job",
                        help="what is lost: every process of the run (job, the default) or "
                             "one node's (node; needs --save-nodes 2 or more)")
    parser.add_argument("--lost-node", default=None, metavar="I|rank0",
                        help="with --kill node: the node lost, 0 to D-1 (0 hosts the "
                             "rendezvous), or rank0 (the node of rank 0, which holds the "
                             "lease); default one at random")
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="S",
                        help=f"steps of every run (default {DEFAULT_STEPS})")
    parser.add_argument("--interrupt-at", type=positive_int, default=None, metavar="K",
                        help="kill after the checkpoint of this step (default S/2); must be "
                             "a multiple of checkpoint.interval_steps, which defaults to the "
                             f"largest divisor of K up to {MAX_DEFAULT_INTERVAL}")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="where runs and reports go")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("--timeout", type=positive_int, default=900, metavar="SECONDS",
                        help="limit for each run (default 900)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides for every run (after the drill's small model)")
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> Drill:
    """Check every argument before anything runs; raises ValueError with the reason."""
    if args.tier == "memory":
        return _part(parts.MEMORY_TIER, "--tier memory", "drill_memory").prepare(args)
    k = args.interrupt_at if args.interrupt_at is not None else args.steps // 2
    if not 0 < k < args.steps:
        raise ValueError(f"--interrupt-at must be at least 1 and below --steps={args.steps}, "
                         f"so that training runs on after the checkpoint (got {k})")
    for item in args.overrides:
        if (key := item.split("=", 1)[0]) in OWNED_KEYS:
            raise ValueError(f"{key} is set by the drill; use {OWNED_KEYS[key]} instead")
    default = max(d for d in range(1, MAX_DEFAULT_INTERVAL + 1) if k % d == 0)
    overrides = [*small_model(args), f"checkpoint.interval_steps={default}", *args.overrides]
    cfg = load_config(args.config, overrides)
    check_config(load_task(), cfg)
    interval = cfg.checkpoint.interval_steps
    if k % interval:
        raise ValueError(f"checkpoint.interval_steps={interval} does not divide --interrupt-at "
                         f"{k}: the run is killed after the checkpoint of step {k}, so step {k} "
                         "must be a save step")
    for ranks in (args.save_ranks, args.resume_ranks):
        split_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, ranks)
    check_devices(cfg, max(args.save_ranks, args.resume_ranks))
    return Drill(args.save_ranks, args.resume_ranks, args.steps, k, interval,
                 args.out.resolve(), config_path(args), overrides, cfg, float(args.timeout),
                 save_nodes=args.save_nodes, kill=args.kill, lost_node=_lost_node(args))


def _lost_node(args: argparse.Namespace) -> int | str | None:
    """The node ``--kill node`` loses (None for one node and ``--kill job``)."""
    if args.save_nodes == 1 and args.kill == "job" and args.lost_node is None:
        return None
    setting = f"--save-nodes {args.save_nodes}" if args.save_nodes > 1 else f"--kill {args.kill}"
    return _part(parts.NODE_DRILL, setting, "drill_nodes").lost_node(args)


def _part(part: parts.Part, setting: str, module: str) -> ModuleType:
    """The drill module of an optional part, or the refusal that names its copier answer."""
    if not parts.rendered(part):
        raise ValueError(parts.missing(part, setting))
    return import_module(f".{module}", __package__)


def prepare_out(out: Path) -> None:
    """Make DIR ready: create it, or clear what an earlier drill wrote there."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if (out.is_dir() and any(p.name != IGNORE_FILE for p in out.iterdir())
            and not (out / MARKER).exists()):
        raise ValueError(f"--out {out} is not empty and was not made by a drill; choose a new "
                         "or empty directory (the drill will not delete files it did not write)")
    make_output_dir(out)   # a new one ignores itself in git
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (out / MARKER).write_text("written by the interruption drill; its outputs here are "
                              "replaced by the next drill run\n")


@refusals
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        drill = prepare(args)
        prepare_out(drill.out)
    except (ConfigError, BatchSizeError, ValueError) as exc:
        raise Refused(exc) from exc
    try:
        # --tier memory: the memory tier's drill (prepare checked that it is rendered).
        report = (import_module(".drill_memory", __package__).run(drill)
                  if drill.tier == "memory" else run_drill(drill))
    except DrillError as exc:
        drill_report.failure(drill, str(exc))
        drill.say(f"drill failed: {exc}")
        return exit_codes.FAILED
    except KeyboardInterrupt:  # the running job was killed on the way out
        drill.say("drill interrupted; its runs are stopped")
        return 128 + signal.SIGINT
    drill.say(f"{'PASSED' if report['passed'] else 'FAILED'}: {report['verdict']}")
    drill.say(f"report: {drill.out / 'report.md'}")
    return 0 if report["passed"] else exit_codes.FAILED
