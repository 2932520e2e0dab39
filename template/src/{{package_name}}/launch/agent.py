"""torchrun's agent, as ``resume`` runs it: a stop it was asked for ends in one line.

    python -m <package>.launch.agent <torchrun's arguments>

torchrun (``torch.distributed.run``) answers SIGTERM, SIGINT or a forwarded SIGUSR1 by
stopping its workers and raising ``SignalException``, whose traceback is printed after
the workers' clean save: the user sees a crash where there was none. This entry runs the
same ``main`` and turns that one exception into one line; its exit status stays
torchrun's (1), which ``resume`` translates (``launch/verdict.py``). Every other
error keeps its traceback. ``resume --dry-run`` prints the plain torchrun command: the
two take the same arguments.
"""

import sys

from .. import PACKAGE

TORCHRUN_MODULE = "torch.distributed.run"


def as_agent(command: list[str]) -> list[str]:
    """``command`` (a ``torchrun_command``) with this entry in place of torchrun's module;
    any other command as it is."""
    if TORCHRUN_MODULE not in command:
        return list(command)
    at = command.index(TORCHRUN_MODULE)
    return [*command[:at], f"{PACKAGE}.launch.agent", *command[at + 1:]]


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as exc:
        print(f"torchrun: stopped its workers on {exc.sigval.name}", file=sys.stderr,
              flush=True)
        return 1   # what torchrun itself exits with after a signal
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
