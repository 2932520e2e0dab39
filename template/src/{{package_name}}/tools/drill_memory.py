"""``drill --tier memory``: the memory tier's three failures, each against an uninterrupted run.

    python -m <package>.drill --tier memory --save-ranks N --resume-ranks N --out DIR
                              [--steps S] [--interrupt-at K] [key=value ...]

Durable checkpoints every K steps, memory copies every ``checkpoint.memory_interval_steps``
(default 1). Each failure comes at a random step t between K+2 and 2K-1, once the
memory copy of t is committed: newer than the durable checkpoint of step K.

1. reference  S steps on N ranks, one node, without interruption.
2. worker     N ranks on one node under ``resume``; one worker SIGKILLed. torchrun
              restarts the workers in place: they must load their node's memory copies.
3. node       N ranks on two nodes (this machine, each node its own ``resume`` and
              ``checkpoint.memory_dir``); one node's process tree SIGKILLed and its
              memory folder deleted (its RAM is gone). The other node exits 74; both
              start again (the lost one empty): the lost ranks' copies come from their
              partners on the surviving node.
4. job        N ranks on one node; every process SIGKILLed and the memory folder
              deleted (every machine gone): the restart must load durable storage.

Each passes when the restart loaded the expected tier, lost at most one memory
interval of steps (worker, node) and every step after it is bit-identical to the
reference. DIR receives reference/, worker/, node/, job/, report.json and report.md.
"""

from __future__ import annotations

import hashlib
import random
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from .. import PACKAGE
from ..recovery.attempts import read_records
from ..runtime import exit_codes
from ..runtime.metrics import Event, EventTail
from . import drill_nodes, drill_report
from .drill_report import DrillError
from .process_tree import kill_tree, process_tree

OUTPUTS = ("reference", "worker", "node", "job")
KINDS = {"worker": "memory", "node": "memory", "job": "durable"}   # the tier each must load


def memory_interval(drill) -> int:
    return int(drill.cfg.checkpoint.memory_interval_steps)


def memory_base(drill) -> Path:
    """This drill's memory folders: under /dev/shm (RAM) where it exists."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else drill.out
    return base / f"{PACKAGE}-drill-{hashlib.sha1(str(drill.out).encode()).hexdigest()[:10]}"


def clear(drill) -> None:
    """Free the drill's memory folders (a run that failed keeps its copies there)."""
    shutil.rmtree(memory_base(drill), ignore_errors=True)


def _memory_dir(drill, name: str, node: int) -> Path:
    return memory_base(drill) / name / f"node{node}"


def _commands(drill, name: str, nodes: int) -> list[list[str]]:
    """One command per node; each node its own memory folder."""
    if nodes == 1:   # N = M ranks (prepare_memory)
        return [drill.resume_command(name, (f"checkpoint.memory_dir={_memory_dir(drill, name, 0)}",))]
    config = ["--config", drill.config] if drill.config else []
    plan = drill_nodes.Nodes.plan(nodes, drill.save_ranks)
    return [plan.command(node, config, [*drill.run_dirs(name),
                                        f"checkpoint.memory_dir={_memory_dir(drill, name, node)}"])
            for node in range(nodes)]


def _worker_of_rank(log_dir: Path, rank: int) -> int | None:
    """The pid of the running worker of ``rank`` (its attempt record)."""
    return next((int(r["pid"]) for r in read_records(log_dir)
                 if r["rank"] == rank and r["state"] == "running"), None)


def _run_until(drill, procs, logs: list[Path], tail: EventTail, target: int) -> int:
    """Wait until the durable checkpoint of step K committed and the memory copy of step
    ``target`` did; the last step seen then."""
    deadline = time.monotonic() + drill.timeout_s
    saved = copied = False
    last = 0
    while not (saved and copied):
        for event in tail.read():
            if event["event"] == Event.step:
                last = max(last, int(event["step"]))
            saved |= event["event"] == Event.save and event.get("step") == drill.interrupt_at
            copied |= event["event"] == Event.memory_save and event.get("step") == target \
                and event.get("error") is None
        if saved and copied:
            break
        ended = next((p for p in procs if p.poll() is not None), None)
        if ended is not None:
            raise DrillError(f"the run ended (exit {ended.returncode}) before the memory "
                             f"copy of step {target}; see {logs[procs.index(ended)]}")
        if time.monotonic() > deadline:
            raise DrillError(f"the memory copy of step {target} did not commit within "
                             f"{drill.timeout_s:g} s; see {logs[0]}")
        time.sleep(0.01)
    return last


def _scenario(drill, start, finish, name: str) -> dict[str, Any]:
    """Run one failure: start, fail at step t, restart as the failure calls for."""
    base = drill.out / name
    k, every = drill.interrupt_at, memory_interval(drill)
    target = k + random.randint(2, k - 1)
    target -= target % every
    nodes = 2 if name == "node" else 1
    commands = _commands(drill, name, nodes)
    logs = [base / (f"node{i}-output.log" if nodes > 1 else "output.log")
            for i in range(nodes)]
    tail = EventTail(base / "logs")
    procs = [start(command, log) for command, log in zip(commands, logs)]
    result: dict[str, Any] = {"failure_at_step": target}
    try:
        last = _run_until(drill, procs, logs, tail, target)
        result["last_step_before"] = last
        result["killed_at"] = time.time()
        if name == "worker":
            pid = _worker_of_rank(base / "logs", drill.save_ranks - 1)
            if pid is None:
                raise DrillError(f"no worker of rank {drill.save_ranks - 1}; see {logs[0]}")
            kill_tree(pid)
            finish(procs[0], drill.timeout_s, "the run with a worker killed", logs[0])
        elif name == "node":
            tree = process_tree(procs[0].pid)
            kill_tree(procs[1].pid)
            shutil.rmtree(_memory_dir(drill, name, 1), ignore_errors=True)   # its RAM
            bound = drill.cfg.recovery.rendezvous_timeout_s + drill_nodes.NOTICE_MARGIN_S
            survivors = drill_nodes.watch_survivors({0: procs[0]}, {0: tree},
                                                    result["killed_at"], bound)
            result["survivor_exit"] = survivors["survivors"].get(0, {}).get("status")
            result["problems"] = survivors["problems"]
            procs = [start(command, base / f"node{i}-resume-output.log")
                     for i, command in enumerate(_commands(drill, name, nodes))]
            for i, proc in enumerate(procs):
                finish(proc, drill.timeout_s, f"the restarted node {i}",
                       base / f"node{i}-resume-output.log")
        else:
            kill_tree(procs[0].pid)
            procs[0].wait()
            shutil.rmtree(_memory_dir(drill, name, 0), ignore_errors=True)   # every machine's
            procs = [start(commands[0], base / "resume-output.log")]
            finish(procs[0], drill.timeout_s, "the resumed job", base / "resume-output.log")
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
    return result


def judge(drill, name: str, run: dict[str, Any], reference: drill_report.Run) -> dict[str, Any]:
    runs = drill_report.split_runs(drill.out / name / "logs")
    problems = []
    if len(runs) < 2:
        return {**run, "passed": False, "verdict": f"expected a restart in {name}/, found "
                f"{len(runs)} start(s)"}
    after = runs[-1]
    resumed = int(after.start["step"])
    tier = after.start.get("resumed_tier")
    lost = run["last_step_before"] - resumed
    if tier != KINDS[name]:
        problems.append(f"the restart loaded the {tier} tier, not the {KINDS[name]} one")
    if name != "job" and lost > memory_interval(drill):
        problems.append(f"{lost} steps lost, more than one memory interval "
                        f"({memory_interval(drill)})")
    if name == "job" and resumed != drill.interrupt_at:
        problems.append(f"resumed from step {resumed}, not the durable step {drill.interrupt_at}")
    if name == "node" and run.get("survivor_exit") != exit_codes.NODE_LOST:
        problems.append(f"the surviving node exited {run.get('survivor_exit')}, not "
                        f"{exit_codes.NODE_LOST}")
    problems += run.pop("problems", [])
    if after.last_step != drill.steps:
        problems.append(f"the restarted run ended at step {after.last_step}, not {drill.steps}")
    diffs = drill_report.compare(reference.steps, after.steps)
    passed, verdict = drill_report.judge(diffs, same_world=True, problems=problems,
                                         expected_steps=list(range(resumed + 1, drill.steps + 1)))
    first = after.steps.get(after.first_step) if after.steps else None
    return {**run, "passed": passed, "verdict": verdict, "resumed_from_step": resumed,
            "resumed_tier": tier, "resumed_from": after.start.get("resumed_from"),
            "steps_lost": lost, "max_abs_loss_diff": diffs["max_abs_loss_diff"],
            "max_abs_grad_norm_diff": diffs["max_abs_grad_norm_diff"],
            "failure_to_first_step_s": first["time"] - run["killed_at"] if first else None}


def run(drill, start, finish) -> dict[str, Any]:
    """The three failures after the reference; writes report.json and report.md."""
    k, every = drill.interrupt_at, memory_interval(drill)
    drill.say(f"1/4 reference: {drill.steps} uninterrupted steps on {drill.save_ranks} ranks "
              f"(durable every {k}, memory every {every}) ...")
    reference_cmd = _commands(drill, "reference", 1)[0]
    proc = start(reference_cmd, drill.out / "reference" / "output.log")
    finish(proc, drill.timeout_s, "the reference run", drill.out / "reference" / "output.log")
    reference = drill_report.split_runs(drill.out / "reference" / "logs")[0]
    # A run that ends with its final state durable frees its node's copies.
    freed = not any(_memory_dir(drill, "reference", 0).glob("*/rank-*"))
    scenarios = {}
    for index, name in enumerate(("worker", "node", "job"), start=2):
        what = {"worker": "SIGKILL one worker (its node's memory survives)",
                "node": "lose one of two nodes (its partner's copies survive)",
                "job": "lose the whole job (durable storage only)"}[name]
        drill.say(f"{index}/4 {name}: {what} ...")
        result = judge(drill, name, _scenario(drill, start, finish, name), reference)
        scenarios[name] = result
        drill.say(f"    {'passed' if result['passed'] else 'FAILED'}: resumed from step "
                  f"{result.get('resumed_from_step')} ({result.get('resumed_tier')}), "
                  f"{result.get('steps_lost')} step(s) lost; {result['verdict']}")
    passed = freed and all(s["passed"] for s in scenarios.values())
    failures = [f"{n}: {s['verdict']}" for n, s in scenarios.items() if not s["passed"]]
    if not freed:
        failures.append("the finished reference run left its memory copies behind")
    commands = {"reference": shlex.join(reference_cmd)}
    report = {"passed": passed, "tier": "memory", "steps": drill.steps,
              "durable_interval_steps": k, "memory_interval_steps": every,
              "world_size": drill.save_ranks, "scenarios": scenarios,
              "freed_at_end": freed,
              "verdict": "; ".join(failures) or ("every failure restarted from the expected "
                                                  "tier and matched the uninterrupted run "
                                                  "step by step"),
              "commands": commands}
    drill_report.write_report(drill.out, report, markdown(report))
    return report


def markdown(r: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {name} | {s.get('failure_at_step')} | {s.get('resumed_tier')} | "
        f"{s.get('resumed_from_step')} | {s.get('steps_lost')} | "
        f"{drill_report.num(s.get('failure_to_first_step_s'))} | "
        f"{'passed' if s['passed'] else 'FAILED'} |"
        for name, s in r["scenarios"].items())
    return (f"# Drill of the memory tier: {'PASSED' if r['passed'] else 'FAILED'}\n\n"
            f"{r['verdict']}.\n\n{r['world_size']} ranks, {r['steps']} steps, durable "
            f"checkpoints every {r['durable_interval_steps']} steps, memory copies every "
            f"{r['memory_interval_steps']}.\n\n"
            "| failure | at step | restarted from | step | steps lost | failure → first step (s) "
            "| verdict |\n|---|---|---|---|---|---|---|\n" + rows + "\n")

