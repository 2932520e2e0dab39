"""The interruption drill's settings and the runs it starts, shared by its tiers.

``Drill`` and its commands, the config every drill run gets, and the bounded start, wait
and kill of the runs, for drill.py and the optional drills (docs/RESUMING.md, "The
interruption drill").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .. import PACKAGE
from ..config import Config, load_config
from ..launch.torchrun import torchrun_command
from ..runtime.metrics import Event, EventTail
from ..runtime.process_tree import kill_tree
from . import drill_report
from .drill_report import DrillError

# The three runs in about a minute on two CPU cores (default task; only keys its model:
# section has); the user's key=value overrides come after and win.
SMALL_MODEL = ("model.d_model=32", "model.n_layers=1")
# The drill decides these itself; setting them would break the comparison.
OWNED_KEYS = {"train.max_steps": "--steps", "checkpoint.dir": "--out", "log.dir": "--out"}
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

    def run_args(self, name: str) -> list[str]:
        base = self.out / name
        config = ["--config", self.config] if self.config else []
        return [*config, *self.overrides, f"train.max_steps={self.steps}",
                f"checkpoint.dir={base / 'checkpoints'}", f"log.dir={base / 'logs'}"]

    def train_command(self, name: str) -> list[str]:
        return torchrun_command("train", self.run_args(name), self.cfg.preemption,
                                nproc_per_node=self.save_ranks,
                                max_restarts=self.cfg.recovery.max_restarts,
                                warm_start=self.cfg.recovery.warm_start)

    def resume_command(self, name: str = "interrupted") -> list[str]:
        return [sys.executable, "-m", f"{PACKAGE}.resume",
                "--nproc-per-node", str(self.resume_ranks), *self.run_args(name)]

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {message}", flush=True)


def small_model(args: argparse.Namespace) -> list[str]:
    """The drill's small model, for the keys the task's model: section has."""
    own = load_config(args.config, args.overrides).model
    return [item for item in SMALL_MODEL if item.split("=")[0].split(".", 1)[1] in own]


def config_path(args: argparse.Namespace) -> str | None:
    return str(Path(args.config).resolve()) if args.config else None


def check_devices(cfg: Config, ranks: int) -> None:
    import torch

    if (torch.cuda.is_available() and cfg.distributed.backend != "gloo"
            and ranks > (count := torch.cuda.device_count())):
        raise ValueError(f"{ranks} ranks need {ranks} GPUs, this machine has {count}; "
                         "use fewer ranks or distributed.backend=gloo to drill on CPU")


def start(command: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # torchrun sets one OpenMP thread per worker only for several workers: the same for
    # one keeps N and M ranks' throughput comparable and a one-rank CPU run in its cores.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_to_end(drill: Drill, command: list[str], log_path: Path, what: str) -> None:
    finish(start(command, log_path), drill.timeout_s, what, log_path)


def finish(proc: subprocess.Popen, timeout_s: float, what: str, log_path: Path) -> None:
    """Wait for a run that must end with exit status 0 (bounded)."""
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise DrillError(f"{what} did not finish within {timeout_s:g} s (killed); "
                         f"see {log_path}") from None
    except BaseException:
        if proc.poll() is None:  # Ctrl-C or an error here: leave no training behind
            kill_tree(proc.pid)
        raise
    if code != 0:
        raise DrillError(f"{what} exited {code}; see {log_path}")


def output_logs(base: Path, nodes: int) -> list[Path]:
    return ([base / "output.log"] if nodes == 1 else
            [base / f"node{node}-output.log" for node in range(nodes)])


@contextmanager
def running(commands: list[list[str]], logs: list[Path]) -> Iterator[list[subprocess.Popen]]:
    """The runs of ``commands`` (one per node): killed on an error or Ctrl-C, always waited for."""
    procs = [start(command, log) for command, log in zip(commands, logs)]
    try:
        yield procs
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
        raise
    finally:
        for proc in procs:
            proc.wait()


def wait_past(drill: Drill, procs: list[subprocess.Popen], logs: list[Path], tail: EventTail,
              target: int) -> None:
    """Wait until the checkpoint of step K has committed and step ``target`` has run."""
    k = drill.interrupt_at
    saved = passed = False
    deadline = time.monotonic() + drill.timeout_s
    while not (saved and passed):
        for event in tail.read():
            saved |= event["event"] == Event.save and event.get("step") == k
            passed |= event["event"] == Event.step and event.get("step", 0) >= target
        if saved and passed:
            break
        if (ended := next((p for p in procs if p.poll() is not None), None)) is not None:
            raise DrillError(
                f"the run ended (exit {ended.returncode}) before the checkpoint of step "
                f"{k} committed and a later step ran; use more --steps or a smaller "
                f"--interrupt-at; see {logs[procs.index(ended)]}")
        if time.monotonic() > deadline:
            raise DrillError(f"step {k} was not saved and passed within "
                             f"{drill.timeout_s:g} s; see {logs[0]}")
        time.sleep(POLL_S)


def say_killed(drill: Drill, kill: dict, name: str = "interrupted") -> None:
    before = drill_report.split_runs(drill.out / name / "logs")[0]
    drill.say(f"    killed {kill['processes_killed']} processes at step "
              f"{before.last_step} (checkpoint of step {drill.interrupt_at} committed)")
