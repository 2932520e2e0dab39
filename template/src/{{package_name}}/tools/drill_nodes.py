"""The drill on several nodes: one torchrun agent per node on this machine, and a node lost.

Each node is what a launch file starts on a machine of its own: ``python -m
<package>.resume --nnodes N --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID`` with its share
of the ranks, the agents meeting through torchrun's c10d rendezvous on the loopback
address; node 0 hosts the rendezvous store (``--rdzv-conf is_host=1``), as the first
node of a Slurm allocation or index 0 of a Kubernetes Indexed Job does.

``--kill node`` SIGKILLs one node's whole process tree (its ``resume``, torchrun, the
workers and their checkpoint processes) with no signal to anyone else, as a vanished
spot VM would, and then watches the others: each must stop its workers by itself,
within ``recovery.rendezvous_timeout_s`` and a margin, leave nothing running and exit
74 (``exit_codes.NODE_LOST``), a status every launch file retries. Then no committed
checkpoint may fail its checksums.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import PACKAGE
from ..checkpoint.store import layout
from ..checkpoint.store.lease import Lease
from ..checkpoint.store.storage import open_storage
from ..recovery.attempts import read_records
from ..runtime import exit_codes
from .process_tree import process_tree

# Beyond recovery.rendezvous_timeout_s, the time a surviving node may take to notice the
# loss (a collective with a vanished peer fails at once; a silent one meets the step
# watchdog) and to stop its workers and checkpoint processes.
NOTICE_MARGIN_S = 60.0
RANK0 = "rank0"   # --lost-node: the node where rank 0 runs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Nodes:
    """The agents of one multi-node run: a command per node, all meeting at one endpoint."""

    count: int
    ranks_per_node: int
    endpoint: str
    rdzv_id: str

    @classmethod
    def plan(cls, count: int, ranks: int) -> Nodes:
        return cls(count, ranks // count, f"127.0.0.1:{free_port()}",
                   f"drill-{uuid.uuid4().hex[:8]}")

    def command(self, node: int, config: list[str], run_args: list[str]) -> list[str]:
        return [sys.executable, "-m", f"{PACKAGE}.resume",
                "--nproc-per-node", str(self.ranks_per_node), "--nnodes", str(self.count),
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id,
                "--rdzv-conf", f"is_host={1 if node == 0 else 0}", *config, *run_args]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    if Path("/proc/self/stat").exists():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def watch_survivors(procs: dict[int, subprocess.Popen], trees: dict[int, list[int]],
                    killed_at: float, bound_s: float) -> dict[str, Any]:
    """Wait for every surviving node's ``resume`` to exit, up to ``bound_s`` after the
    kill; what each did, and the problems (None when they behaved)."""
    exits: dict[int, dict[str, Any]] = {}
    problems = []
    deadline = killed_at + bound_s
    for node, proc in procs.items():
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            problems.append(f"node {node} did not stop within {bound_s:g} s of the loss "
                            "(recovery.rendezvous_timeout_s and a notice margin)")
            continue
        exits[node] = {"status": code, "seconds": round(time.time() - killed_at, 2)}
        if code != exit_codes.NODE_LOST:
            problems.append(f"node {node} exited {code}, not {exit_codes.NODE_LOST} (a node "
                            "lost, which every launch file retries)")
    time.sleep(0.5)  # torchrun's last children reaped
    left = sorted(pid for node in exits for pid in trees[node] if alive(pid))
    if left:
        problems.append(f"the surviving nodes left {len(left)} process(es) running: "
                        f"{', '.join(map(str, left[:8]))}")
    return {"survivors": exits, "left_running": left, "problems": problems}


def torn_checkpoints(checkpoint_dir: str) -> list[str]:
    """Committed checkpoints that fail their checksums (an uncommitted one is not torn:
    nothing ever loads it)."""
    storage = open_storage(checkpoint_dir)
    failed = []
    for name in layout.checkpoint_names(storage):
        verdict = layout.verify_checkpoint(storage, name, "all")
        if verdict.failed:
            failed.append(f"{name}: {verdict.reason}")
    return failed


def lease_holder(checkpoint_dir: str) -> str | None:
    """Who holds the checkpoint directory's lease now, in words (None: nobody)."""
    owner = Lease(open_storage(checkpoint_dir), stale_s=1.0, wait_s=0.0).owner()
    return owner.describe(time.time()) if owner is not None else None


def ranks_killed(log_dir: Path) -> list[int]:
    """The ranks whose exit record still says ``running``: those that died without a word,
    the lost node's (read before anything starts again)."""
    return sorted(int(r["rank"]) for r in read_records(log_dir) if r["state"] == "running")


def node_of_rank(rank: int, log_dir: Path, procs: list[subprocess.Popen]) -> int | None:
    """The node whose process tree runs ``rank`` (its exit record names its pid)."""
    pid = next((r["pid"] for r in read_records(log_dir)
                if r["rank"] == rank and r["state"] == "running"), None)
    for node, proc in enumerate(procs):
        if pid in process_tree(proc.pid):
            return node
    return None


def lost_node(args: argparse.Namespace) -> int | str | None:
    """Check the node arguments; the node ``--kill node`` loses (None for ``--kill job``)."""
    if args.save_ranks % args.save_nodes:
        raise ValueError(f"--save-ranks {args.save_ranks} does not split evenly over "
                         f"--save-nodes {args.save_nodes}")
    if args.kill == "job":
        if args.lost_node is not None:
            raise ValueError("--lost-node needs --kill node")
        return None
    if args.save_nodes < 2:
        raise ValueError("--kill node needs --save-nodes 2 or more: with one node, losing "
                         "it is losing the job (--kill job)")
    if args.lost_node is None:
        return random.randrange(args.save_nodes)
    if args.lost_node == RANK0:
        return RANK0
    if not args.lost_node.isdigit() or int(args.lost_node) >= args.save_nodes:
        raise ValueError(f"--lost-node must be 0 to {args.save_nodes - 1} or {RANK0} "
                         f"(got {args.lost_node})")
    return int(args.lost_node)
