"""torchrun's agent, as ``resume`` runs it: a stop it was asked for ends in one line.

    python -m <package>.launch.agent [--orphan-signal=NAME] <torchrun's arguments>

It runs torchrun's ``main`` on any supported torch, a clean stop's ``SignalException``
made one line (the status stays torchrun's 1: ``launch/verdict.py``). ``--orphan-signal``:
once ``resume`` is gone it gives itself that signal, which torchrun forwards to the
workers. docs/PREEMPTION.md, "Bounded waits".
"""

import os
import signal
import sys
import threading

from ..runtime.lifeline import on_parent_gone, say_if_heard
from .warm import ZYGOTE_ENV
from .zygote import Started, watch_me

ORPHAN_SIGNAL = "--orphan-signal="   # the agent's own options; first, before torchrun's
WARM_START = "--warm-start"           # workers forked from a zygote (launch/zygote.py)


def watched(command: list[str], stop: str) -> list[str]:
    """``command`` with the agent told to stop the workers with ``stop`` once its parent is gone."""
    at = next((i for i, arg in enumerate(command) if arg.endswith(".launch.agent")), None)
    if at is None:
        return list(command)     # not this agent: nothing to tell it
    return [*command[:at + 1], f"{ORPHAN_SIGNAL}{stop}", *command[at + 1:]]


def watch_parent(stop: signal.Signals) -> threading.Thread:
    """Give this process ``stop`` once its parent is gone."""
    parent = os.getppid()

    def stop_workers() -> None:
        os.kill(os.getpid(), stop)   # first: a line nobody reads must not cost it
        say_if_heard(f"torchrun: the process that started it ({parent}) is gone: "
                     f"stopping the workers with {stop.name}")

    return on_parent_gone(parent, stop_workers, name="resume-watch")


def main(argv: list[str]) -> int:
    zygote = None
    while argv and argv[0].startswith((ORPHAN_SIGNAL, WARM_START)):
        if argv[0] == WARM_START and os.environ.get(ZYGOTE_ENV):
            watch_me(os.environ[ZYGOTE_ENV])   # resume started it: it ends with this agent
        elif argv[0] == WARM_START:   # first: its imports beside this process's own
            zygote = Started(next((a.split("=", 1)[1] for a in argv
                                   if a.startswith("--nproc-per-node=")), None))
            os.environ[ZYGOTE_ENV] = zygote.path
        else:
            watch_parent(signal.Signals[argv[0][len(ORPHAN_SIGNAL):]])
        argv = argv[1:]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    from ..runtime.torch_compat import torchrun_arguments

    try:
        torchrun(torchrun_arguments(argv))
    except SignalException as exc:
        print(f"torchrun: stopped its workers on {exc.sigval.name}", file=sys.stderr,
              flush=True)
        return 1   # what torchrun itself exits with after a signal
    finally:
        if zygote is not None:
            zygote.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
