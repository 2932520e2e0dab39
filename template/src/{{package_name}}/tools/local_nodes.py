"""Several nodes on this machine: one ``resume`` (a torchrun agent) per node.

Each is what a launch file starts on a machine of its own, the agents meeting through
torchrun's c10d rendezvous on the loopback address; node 0 hosts the store (``--rdzv-conf
is_host=1``) as a Slurm allocation's first node or a Kubernetes Indexed Job's index 0
does. For the multi-node drill (drill_nodes.py, rendered with multi_node_drill) and tests.
"""

from __future__ import annotations

import socket
import sys
import uuid
from dataclasses import dataclass

from .. import PACKAGE


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
