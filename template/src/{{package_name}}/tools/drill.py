"""The interruption drill: lose a run the hard way, resume it, and check that nothing changed.

    python -m <package>.drill --save-ranks N --resume-ranks M --out DIR
                              [--save-nodes D] [--kill job|node] [--lost-node I|rank0]
                              [--steps S] [--interrupt-at K] [--config PATH]
                              [--timeout SECONDS] [key=value ...]
    python -m <package>.drill --tier memory --save-ranks N --resume-ranks N --out DIR ...

``--tier memory`` rehearses the memory tier's three losses instead (tools/drill_memory.py,
rendered with memory_tier).

1. reference    S steps on N ranks without interruption.
2. interrupted  the same run on N ranks, killed with SIGKILL (torchrun, its workers and
                the checkpoint background processes, as when a machine is lost) once
                the checkpoint of step K has committed and training has moved past it.
                With ``--save-nodes D`` the interrupted run is D nodes on this machine,
                each its own ``resume`` and torchrun agent with N/D ranks, meeting
                through torchrun's rendezvous; ``--kill node`` then kills one node only
                (``--lost-node``: a node index, node 0 hosting the rendezvous, or
                ``rank0``, the node where rank 0 holds the lease and commits; default
                a node at random),
                a random number of steps after the checkpoint, and checks that the
                others stop by themselves within recovery.rendezvous_timeout_s and a
                margin, exit 74, leave nothing running and no torn checkpoint
                (tools/drill_nodes.py, rendered with multi_node_drill).
3. resume       ``python -m <package>.resume --nproc-per-node M`` in the interrupted
                run's directories, to step S: the command a launcher runs after a loss
                (after a node loss: on the surviving node alone).
4. compare      loss and grad norm of every step after the resume point, against 1.

Passed: on the same world size the resumed steps are bit-identical to the reference
(losses and grad norms equal: weights, optimizer, data position, learning rate and
random streams all carried over). On another world size the random streams are
reseeded and sums run in another order, so the criterion is a relative loss difference
below 1e-4, with ``model.dropout=0`` (the default).

The default task's model is made small unless your key=value overrides say otherwise
(they come last).
DIR receives reference/, interrupted/, report.json, report.md and loss.png. A re-run
into the same DIR replaces exactly those; a non-empty DIR that no drill made is
refused. Exit status: 0 passed, 1 failed, 2 refused (bad arguments; nothing ran).

(About 470 lines: the command line and the argument checks of both tiers, and the
phases of the durable drill; the report, the nodes and the memory tier's losses are in
drill_report.py, drill_nodes.py and drill_memory.py.)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import PACKAGE
from ..config import Config, ConfigError, load_config, parts
from ..launch.torchrun import positive_int, torchrun_command
from ..loop.sampling import BatchSizeError, split_global_batch
from ..loop.task_contract import check_config, load_task
from ..runtime import exit_codes
from ..runtime.metrics import Event, EventTail
from ..runtime.output_dirs import IGNORE_FILE, make_output_dir
from ..runtime.process_tree import kill_tree, process_tree
from . import drill_report
from .drill_report import DrillError
from .local_nodes import Nodes

DEFAULT_STEPS = 24
# The default save interval is the largest divisor of K up to this, so that a few
# checkpoints commit (and old ones are retired) before the one the run resumes from.
MAX_DEFAULT_INTERVAL = 4
# Small enough that the three runs take about a minute on two CPU cores, for the default
# task (applied only to keys its model: section has); the user's key=value overrides
# come after these and win.
SMALL_MODEL = ("model.d_model=32", "model.n_layers=1")
# The drill decides these itself; setting them would break the comparison.
OWNED_KEYS = {"train.max_steps": "--steps", "checkpoint.dir": "--out", "log.dir": "--out"}
MARKER = ".drill"
# With the memory tier's runs (tools/drill_memory.py, rendered with memory_tier).
OUTPUTS = ("reference", "interrupted", "report.json", "report.md", "loss.png",
           "worker", "node", "job")
POLL_S = 0.01


@dataclass
class Drill:
    save_ranks: int
    resume_ranks: int
    steps: int
    interrupt_at: int
    interval: int
    out: Path
    config: str | None
    overrides: list[str]
    cfg: Config
    timeout_s: float
    save_nodes: int = 1
    tier: str = "durable"              # durable | memory (the memory tier's drill)
    kill: str = "job"                  # job | node
    lost_node: int | str | None = None   # --kill node: which node is lost (an index, "rank0")
    started: float = field(default_factory=time.monotonic)
    commands: dict[str, list[str]] = field(default_factory=dict)

    def run_dirs(self, name: str) -> list[str]:
        base = self.out / name
        return [*self.overrides, f"train.max_steps={self.steps}",
                f"checkpoint.dir={base / 'checkpoints'}", f"log.dir={base / 'logs'}"]

    def train_command(self, name: str) -> list[str]:
        config = ["--config", self.config] if self.config else []
        return torchrun_command("train", [*config, *self.run_dirs(name)], self.cfg.preemption,
                                nproc_per_node=self.save_ranks,
                                max_restarts=self.cfg.recovery.max_restarts,
                                warm_start=self.cfg.recovery.warm_start)

    def node_commands(self, name: str, nodes: Nodes) -> list[list[str]]:
        config = ["--config", self.config] if self.config else []
        return [nodes.command(node, config, self.run_dirs(name)) for node in range(nodes.count)]

    def resume_command(self, name: str = "interrupted", extra: tuple[str, ...] = ()) -> list[str]:
        config = ["--config", self.config] if self.config else []
        return [sys.executable, "-m", f"{PACKAGE}.resume",
                "--nproc-per-node", str(self.resume_ranks), *config,
                *self.run_dirs(name), *extra]

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {message}", flush=True)


# ------------------------------------------------------------------- phases --
def _start(command: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # torchrun gives each worker one OpenMP thread when it starts several, but not when it
    # starts one; the same setting everywhere keeps the throughput of N and M ranks
    # comparable (and keeps a one-rank CPU run from oversubscribing the cores).
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait(proc: subprocess.Popen, timeout_s: float, what: str, log_path: Path) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise DrillError(f"{what} did not finish within {timeout_s:g} s (killed); "
                         f"see {log_path}") from None


def run_to_end(drill: Drill, command: list[str], log_path: Path, what: str) -> None:
    finish(_start(command, log_path), drill.timeout_s, what, log_path)


def finish(proc: subprocess.Popen, timeout_s: float, what: str, log_path: Path) -> None:
    """Wait for a run that must end with exit status 0 (bounded)."""
    try:
        code = _wait(proc, timeout_s, what, log_path)
    except BaseException:
        if proc.poll() is None:  # Ctrl-C or an error here: leave no training behind
            kill_tree(proc.pid)
        raise
    if code != 0:
        raise DrillError(f"{what} exited {code}; see {log_path}")


def run_and_kill(drill: Drill, commands: list[list[str]], name: str) -> dict:
    """Start the run (one command per node) and kill it once step K is committed and
    passed: every node's process tree (``--kill job``) or one node's (``--kill node``,
    a random number of steps later, before the next checkpoint; then the others are
    watched as they stop by themselves)."""
    base = drill.out / name
    logs = ([base / "output.log"] if len(commands) == 1 else
            [base / f"node{node}-output.log" for node in range(len(commands))])
    tail = EventTail(base / "logs")
    k = drill.interrupt_at
    lost = drill.lost_node if drill.kill == "node" else None
    # A node is lost at a random step after the checkpoint, before the next one starts.
    target = k + 1 + (random.randint(0, max(0, drill.interval - 2)) if lost is not None else 0)
    saved = passed = False
    procs = [_start(command, log) for command, log in zip(commands, logs)]
    deadline = time.monotonic() + drill.timeout_s
    result: dict = {}
    try:
        while not (saved and passed):
            for event in tail.read():
                saved |= event["event"] == Event.save and event.get("step") == k
                passed |= event["event"] == Event.step and event.get("step", 0) >= target
            if saved and passed:
                break
            ended = next((p for p in procs if p.poll() is not None), None)
            if ended is not None:
                raise DrillError(
                    f"the run ended (exit {ended.returncode}) before the checkpoint of step "
                    f"{k} committed and a later step ran; use more --steps or a smaller "
                    f"--interrupt-at; see {logs[procs.index(ended)]}")
            if time.monotonic() > deadline:
                raise DrillError(f"step {k} was not saved and passed within "
                                 f"{drill.timeout_s:g} s; see {logs[0]}")
            time.sleep(POLL_S)
        if lost is None:
            killed_at = time.time()
            killed = sum(kill_tree(proc.pid) for proc in procs)
        else:
            from . import drill_nodes
            if lost == drill_nodes.RANK0:
                lost = drill_nodes.node_of_rank(0, base / "logs", procs)
                if lost is None:
                    raise DrillError(f"rank 0 runs on none of the nodes; see {logs[0]}")
            others = {node: proc for node, proc in enumerate(procs) if node != lost}
            trees = {node: process_tree(proc.pid) for node, proc in others.items()}
            killed_at = time.time()
            killed = kill_tree(procs[lost].pid)
            bound = drill.cfg.recovery.rendezvous_timeout_s + drill_nodes.NOTICE_MARGIN_S
            result = drill_nodes.watch_survivors(others, trees, killed_at, bound)
            for proc in others.values():
                if proc.poll() is None:  # past the bound (a problem already): stop it
                    kill_tree(proc.pid)
            checkpoints = str(base / "checkpoints")
            torn = drill_nodes.torn_checkpoints(checkpoints)
            result["problems"] += [f"torn checkpoint {item}" for item in torn]
            result.update(lost_node=lost, rendezvous_host=lost == 0, bound_s=bound,
                          lost_ranks=drill_nodes.ranks_killed(base / "logs"),
                          lease_after=drill_nodes.lease_holder(checkpoints))
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
        raise
    finally:
        for proc in procs:
            proc.wait()
    return {"killed_at": killed_at, "processes_killed": killed, "node_loss": result or None}


def run_drill(drill: Drill) -> dict:
    n, m, s, k = drill.save_ranks, drill.resume_ranks, drill.steps, drill.interrupt_at
    drill.commands = {"reference": drill.train_command("reference")}
    if drill.save_nodes == 1:
        interrupted = [drill.train_command("interrupted")]
        drill.commands["interrupted"] = interrupted[0]
    else:
        nodes = Nodes.plan(drill.save_nodes, n)
        interrupted = drill.node_commands("interrupted", nodes)
        drill.commands.update({f"interrupted, node {node}": command
                               for node, command in enumerate(interrupted)})
    drill.commands["resume"] = drill.resume_command()

    drill.say(f"1/4 reference: {s} uninterrupted steps on {n} rank(s) ...")
    run_to_end(drill, drill.commands["reference"], drill.out / "reference" / "output.log",
               "the reference run")

    where = f"{n} rank(s)" + (f" on {drill.save_nodes} nodes" if drill.save_nodes > 1 else "")
    whom = "the whole job" if drill.kill == "job" else _lost_node_name(drill.lost_node)
    drill.say(f"2/4 interrupted run on {where}: SIGKILL {whom} once step {k} is committed ...")
    kill = run_and_kill(drill, interrupted, "interrupted")
    before = drill_report.split_runs(drill.out / "interrupted" / "logs")[0]
    drill.say(f"    killed {kill['processes_killed']} processes at step "
              f"{before.last_step} (checkpoint of step {k} committed)")
    loss = kill["node_loss"]
    if loss is not None:
        for node, end in sorted(loss["survivors"].items()):
            drill.say(f"    node {node} noticed and exited {end['status']} "
                      f"{end['seconds']:.1f} s after the loss")
        for problem in loss["problems"]:
            drill.say(f"    problem: {problem}")

    drill.say(f"3/4 resume on {m} rank(s) with {PACKAGE}.resume, to step {s} ...")
    run_to_end(drill, drill.commands["resume"], drill.out / "interrupted" / "resume-output.log",
               "the resumed run")

    drill.say("4/4 compare the steps after the resume point with the reference ...")
    return drill_report.build(drill, kill)


# ------------------------------------------------------------- command line --
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.drill",
        description="Interruption rehearsal: run, kill -9 the whole job after a checkpoint, "
                    "resume on another (or the same) number of ranks, and compare every "
                    "step with an uninterrupted run.",
        epilog=f"Writes DIR/report.json, DIR/report.md and DIR/loss.png. A re-run into the "
               f"same DIR replaces what an earlier drill wrote there ({', '.join(OUTPUTS)}); "
               "a non-empty DIR that no drill made is refused. Exit status: 0 passed, "
               "1 failed, 2 refused.",
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
                             "memory: the memory tier's three losses (a worker, a node, the "
                             "job), each against the uninterrupted run (needs an even N >= 2 "
                             "and M = N; --interrupt-at K is the durable interval, default "
                             "S/3; memory copies every checkpoint.memory_interval_steps, "
                             "default 1)")
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


def default_interval(k: int) -> int:
    return max(d for d in range(1, MAX_DEFAULT_INTERVAL + 1) if k % d == 0)


def prepare(args: argparse.Namespace) -> Drill:
    """Check every argument before anything runs; raises ValueError with the reason."""
    if args.tier == "memory":
        return prepare_memory(args)
    k = args.interrupt_at if args.interrupt_at is not None else args.steps // 2
    if not 0 < k < args.steps:
        raise ValueError(f"--interrupt-at must be at least 1 and below --steps={args.steps}, "
                         f"so that training runs on after the checkpoint (got {k})")
    for item in args.overrides:
        key = item.split("=", 1)[0]
        if key in OWNED_KEYS:
            raise ValueError(f"{key} is set by the drill; use {OWNED_KEYS[key]} instead")
    own = load_config(args.config, args.overrides).model
    small = [item for item in SMALL_MODEL if item.split("=")[0].split(".", 1)[1] in own]
    overrides = [*small, f"checkpoint.interval_steps={default_interval(k)}", *args.overrides]
    cfg = load_config(args.config, overrides)
    check_config(load_task(), cfg)
    interval = cfg.checkpoint.interval_steps
    if k % interval:
        raise ValueError(f"checkpoint.interval_steps={interval} does not divide --interrupt-at "
                         f"{k}: the run is killed after the checkpoint of step {k}, so step {k} "
                         "must be a save step")
    for ranks in (args.save_ranks, args.resume_ranks):
        split_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, ranks)
    _check_devices(cfg, max(args.save_ranks, args.resume_ranks))
    config = str(Path(args.config).resolve()) if args.config else None
    return Drill(args.save_ranks, args.resume_ranks, args.steps, k, interval,
                 args.out.resolve(), config, overrides, cfg, float(args.timeout),
                 save_nodes=args.save_nodes, kill=args.kill, lost_node=_lost_node(args))


def _lost_node_name(lost: int | str | None) -> str:
    from . import drill_nodes
    if lost == drill_nodes.RANK0:
        return "the node of rank 0"
    return f"node {lost}" + (" (the rendezvous host)" if lost == 0 else "")


def _lost_node(args: argparse.Namespace) -> int | str | None:
    """The node ``--kill node`` loses (None for one node and ``--kill job``); more than one
    node needs the multi-node drill (tools/drill_nodes.py, rendered with multi_node_drill)."""
    if args.save_nodes == 1 and args.kill == "job" and args.lost_node is None:
        return None
    if not parts.rendered(parts.NODE_DRILL):
        raise ValueError(parts.missing(parts.NODE_DRILL, f"--save-nodes {args.save_nodes}"
                                       if args.save_nodes > 1 else f"--kill {args.kill}"))
    from . import drill_nodes
    return drill_nodes.lost_node(args)


def prepare_memory(args: argparse.Namespace) -> Drill:
    """``--tier memory``: N = M, even; durable checkpoints every K, memory copies more often."""
    if not parts.rendered(parts.MEMORY_TIER):
        raise ValueError(parts.missing(parts.MEMORY_TIER, "--tier memory"))
    if args.save_ranks != args.resume_ranks or args.save_ranks < 2 or args.save_ranks % 2:
        raise ValueError("--tier memory needs --save-ranks N = --resume-ranks N, N even and at "
                         "least 2 (memory copies are restored on the world size that made "
                         "them; the node loss splits N over two nodes)")
    if args.save_nodes != 1 or args.kill != "job" or args.lost_node is not None:
        raise ValueError("--tier memory runs its own losses (a worker, a node, the job): "
                         "leave out --save-nodes, --kill and --lost-node")
    k = args.interrupt_at if args.interrupt_at is not None else args.steps // 3
    if k < 3 or 2 * k > args.steps:
        raise ValueError(f"--tier memory needs --interrupt-at K >= 3 with 2K <= --steps "
                         f"({args.steps}): the losses come between steps K+2 and 2K-1 "
                         f"(got K={k})")
    for item in args.overrides:
        key = item.split("=", 1)[0]
        if key in {**OWNED_KEYS, "checkpoint.interval_steps": "--interrupt-at",
                   "checkpoint.memory_dir": "the drill's own memory folders"}:
            raise ValueError(f"{key} is set by the drill with --tier memory")
    own = load_config(args.config, args.overrides).model
    small = [item for item in SMALL_MODEL if item.split("=")[0].split(".", 1)[1] in own]
    memory = [] if any(o.startswith("checkpoint.memory_interval_steps=")
                       for o in args.overrides) else ["checkpoint.memory_interval_steps=1"]
    overrides = [*small, f"checkpoint.interval_steps={k}", *memory, *args.overrides]
    cfg = load_config(args.config, overrides)
    check_config(load_task(), cfg)
    every = cfg.checkpoint.memory_interval_steps
    if not 1 <= every <= k - 2:
        raise ValueError(f"checkpoint.memory_interval_steps={every}: --tier memory needs "
                         f"1 to K-2 = {k - 2}, so that a memory copy is newer than the "
                         f"durable checkpoint of step {k}")
    split_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, args.save_ranks)
    _check_devices(cfg, args.save_ranks)
    config = str(Path(args.config).resolve()) if args.config else None
    return Drill(args.save_ranks, args.resume_ranks, args.steps, k, k, args.out.resolve(),
                 config, overrides, cfg, float(args.timeout), tier="memory")


def _check_devices(cfg: Config, ranks: int) -> None:
    import torch

    if torch.cuda.is_available() and cfg.distributed.backend != "gloo":
        count = torch.cuda.device_count()
        if ranks > count:
            raise ValueError(f"{ranks} ranks need {ranks} GPUs, this machine has {count}; "
                             "use fewer ranks or distributed.backend=gloo to drill on CPU")


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        drill = prepare(args)
        prepare_out(drill.out)
    except (ConfigError, BatchSizeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    if drill.tier == "memory":
        return _main_memory(drill)
    drill.say(f"drill: {drill.save_ranks} rank(s) save, {drill.resume_ranks} rank(s) resume; "
              f"{drill.steps} steps, killed after the checkpoint of step {drill.interrupt_at} "
              f"(checkpoints every {drill.interval}); output in {drill.out}")
    try:
        report = run_drill(drill)
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


def _main_memory(drill: Drill) -> int:
    from . import drill_memory  # rendered with memory_tier: prepare_memory checked it
    drill.say(f"drill of the memory tier: {drill.save_ranks} ranks, {drill.steps} steps, durable "
              f"checkpoints every {drill.interval}; output in {drill.out}")
    try:
        report = drill_memory.run(drill, _start, finish)
    except DrillError as exc:
        drill_report.failure(drill, str(exc))
        drill.say(f"drill failed: {exc}")
        return exit_codes.FAILED
    except KeyboardInterrupt:
        drill.say("drill interrupted; its runs are stopped")
        return 128 + signal.SIGINT
    finally:
        drill_memory.clear(drill)
    drill.say(f"{'PASSED' if report['passed'] else 'FAILED'}: {report['verdict']}")
    drill.say(f"report: {drill.out / 'report.md'}")
    return 0 if report["passed"] else exit_codes.FAILED
