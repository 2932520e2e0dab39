"""The torchrun command line, built in one place for resume, drill and the launch files.

torchrun forwards only the signals it is told to handle, and kills the workers
``--shutdown-timeout`` seconds after forwarding one. Both must fit the preemption
settings, or the final checkpoint is cut off mid-write.
"""

from __future__ import annotations

import argparse
import math
import sys

from .config import PreemptionConfig

# torchrun's own defaults; kept so that Ctrl-C and hang-ups still reach the workers.
TORCHRUN_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
SHUTDOWN_MARGIN_S = 30


def positive_int(value: str) -> int:
    """argparse type for counts of processes, nodes and steps."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value!r})")
    return number


def signals_to_handle(preemption: PreemptionConfig) -> str:
    names = list(TORCHRUN_DEFAULT_SIGNALS)
    names += [name for name in preemption.signals if name not in names]
    return ",".join(names)


def shutdown_timeout_s(preemption: PreemptionConfig) -> int:
    """How long torchrun waits for workers after a signal before it kills them."""
    return math.ceil(preemption.grace_period_s) + SHUTDOWN_MARGIN_S


def torchrun_command(module: str, args: list[str], preemption: PreemptionConfig, *,
                     nproc_per_node: int | str, nnodes: str = "1",
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run ... -m <package>.<module> args``.

    One node runs standalone (a free local port); several nodes meet at
    ``rdzv_endpoint`` through the c10d rendezvous.
    """
    cmd = [python, "-m", "torch.distributed.run",
           f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}",
           f"--signals-to-handle={signals_to_handle(preemption)}",
           f"--shutdown-timeout={shutdown_timeout_s(preemption)}"]
    if nnodes == "1" and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need a rendezvous endpoint (--rdzv-endpoint HOST:PORT)")
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id or 'resumable'}"]
    return [*cmd, "-m", f"{__package__}.{module}", *args]
