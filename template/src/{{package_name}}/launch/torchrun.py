"""The torchrun command line, built in one place for resume, drill and the launch files.

It runs torchrun through this package's agent (``launch/agent.py``). torchrun forwards
only the signals it is told to handle, and kills the workers ``--shutdown-timeout``
seconds after forwarding one: both must fit the preemption settings, or the final
checkpoint is cut off mid-write.
"""

from __future__ import annotations

import argparse
import math
import sys

from .. import PACKAGE
from ..config import PreemptionConfig
from .agent import WARM_START

# torchrun's own defaults; kept so that Ctrl-C and hang-ups still reach the workers.
TORCHRUN_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
SHUTDOWN_MARGIN_S = 30
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
DEFAULT_RDZV_ID = "resumable"   # several nodes without --rdzv-id (torchrun's run id)


def positive_int(value: str) -> int:
    """argparse type for counts of processes, nodes and steps."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value!r})")
    return number


def rdzv_conf(value: str) -> dict[str, str]:
    """argparse type for ``--rdzv-conf KEY=VALUE[,KEY=VALUE]`` (torchrun's own format)."""
    conf = {}
    for item in filter(None, value.split(",")):
        key, sep, setting = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE] (got {value!r})")
        if key.strip() == "join_timeout":
            raise argparse.ArgumentTypeError(
                "join_timeout is recovery.rendezvous_timeout_s: set that key instead")
        conf[key.strip()] = setting.strip()
    return conf


def shutdown_timeout_s(preemption: PreemptionConfig) -> int:
    """How long torchrun waits for workers after a signal before it kills them."""
    return math.ceil(preemption.grace_period_s) + SHUTDOWN_MARGIN_S


def torchrun_command(module: str, args: list[str], preemption: PreemptionConfig, *,
                     nproc_per_node: int | str, max_restarts: int, nnodes: str = "1",
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     rendezvous_timeout_s: float | None = None,
                     rdzv_conf: dict[str, str] | None = None,
                     warm_start: bool = False, python: str = sys.executable) -> list[str]:
    """``python -m <package>.launch.agent <torchrun's arguments> -m <package>.<module> args``.

    ``max_restarts``, ``rendezvous_timeout_s`` (torchrun's ``join_timeout``, else 600 s: it
    bounds every meeting of the nodes) and ``warm_start`` are the ``recovery.`` keys.
    """
    if max_restarts < 0:
        raise ValueError(f"recovery.max_restarts must be >= 0 (got {max_restarts})")
    # torchrun's store, lent to the workers, keeps what an attempt wrote: a restarted process
    # group read the dead ranks' addresses (torch 2.13, gloo). Unshared: a fresh one each.
    env = ["env", f"{UNSHARED_STORE}=1"] if max_restarts > 0 else []
    signals = ",".join(dict.fromkeys([*TORCHRUN_DEFAULT_SIGNALS, *preemption.signals]))
    cmd = [*env, python, "-m", f"{PACKAGE}.launch.agent", *([WARM_START] if warm_start else []),
           f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}",
           f"--max-restarts={max_restarts}",
           f"--signals-to-handle={signals}",
           f"--shutdown-timeout={shutdown_timeout_s(preemption)}"]
    if nnodes == "1" and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need a rendezvous endpoint (--rdzv-endpoint HOST:PORT)")
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id or DEFAULT_RDZV_ID}"]
        conf = dict(rdzv_conf or {})
        if rendezvous_timeout_s is not None:
            conf["join_timeout"] = str(math.ceil(rendezvous_timeout_s))
        if conf:
            cmd.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
    return [*cmd, "-m", f"{PACKAGE}.{module}", *args]
