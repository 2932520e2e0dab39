"""Every difference between the torch releases this project runs on, in one place.

Each is answered by behaviour wherever a build can carry a fix its version does not show
(NGC builds). The releases and differences: docs/EXTENDING.md, "Torch releases".
"""

from __future__ import annotations

import functools
import itertools
import re
import signal

import torch

# The oldest release; pyproject.toml's torch>=2.9.0a0 admits NGC's 2.9.0a0 (a test checks).
MIN_TORCH = (2, 9)

SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"
SIGNALS_FLAG = "--signals-to-handle"


def release(version: str) -> tuple[int, int, int]:
    """The numeric release of a torch version string: ``2.12.0a0+git1a2b`` is (2, 12, 0)."""
    match = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(part or 0) for part in match.groups()) if match else (0, 0, 0)


def torch_too_old(version: str = torch.__version__) -> str | None:
    """One sentence when ``version`` is older than ``MIN_TORCH``, else None."""
    if release(version)[:len(MIN_TORCH)] >= MIN_TORCH:
        return None
    oldest = ".".join(map(str, MIN_TORCH))
    return (f"torch {version} is older than {oldest}, the oldest release this project runs "
            f"on (pyproject.toml): install torch>={oldest} into this environment")


@functools.cache
def stager_closes_after_each_stage() -> bool:
    """Whether DCP's ``DefaultStager`` closes its state-dict stager after every stage (2.11,
    2.12.0): a tiny dict staged twice, once per process (about a millisecond)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(2)})
    except KeyError:
        return True
    finally:
        stager.close()
    return False


@functools.cache
def _torchrun_options() -> dict[str, bool]:
    """Each option of this torchrun, and whether it takes a value."""
    from torch.distributed.run import get_args_parser

    return {name: action.nargs != 0 for action in get_args_parser()._actions
            for name in action.option_strings}


def torchrun_takes(flag: str) -> bool:
    """Whether this torchrun's own parser knows ``flag`` (``--signals-to-handle`` from 2.10,
    ``--shutdown-timeout`` from 2.12, or a build that carries it earlier)."""
    return flag in _torchrun_options()


def torchrun_arguments(argv: list[str]) -> list[str]:
    """torchrun's arguments as this torch takes them; a flag it lacks is done here instead."""
    kept = list(argv)
    for flag, do_here in ((SIGNALS_FLAG, _handle_signals),
                          (SHUTDOWN_TIMEOUT_FLAG, _hold_workers_after_signal)):
        if not torchrun_takes(flag):
            kept, value = _take_option(kept, flag)
            if value is not None:
                do_here(value)
    return kept


def _take_option(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """``argv`` without ``flag VALUE`` / ``flag=VALUE`` among torchrun's options; the value."""
    names = {flag, "--" + flag[2:].replace("-", "_")}   # torchrun takes both spellings
    takes_value = _torchrun_options()
    kept: list[str] = []
    value = None
    rest = iter(argv)
    for arg in rest:
        if not arg.startswith("-") or arg in ("-m", "--module"):
            kept += [arg, *rest]     # the script or module, and its arguments: not torchrun's
            break
        name, sep, setting = arg.partition("=")
        if name in names:
            value = setting if sep else next(rest, None)
            continue
        kept.append(arg)
        if not sep and takes_value.get(name, False):
            kept += itertools.islice(rest, 1)   # its value, if there is one
    return kept, value


def _handle_signals(names: str) -> None:
    """What ``--signals-to-handle`` does from 2.10: torchrun's own handler for each signal."""
    from torch.distributed.elastic.multiprocessing import api

    for name in filter(None, (n.strip() for n in names.split(","))):
        signal.signal(getattr(signal, name), api._terminate_process_handler)


def _hold_workers_after_signal(timeout: str) -> None:
    """torchrun waits ``timeout`` seconds (not 30) for the workers after a signal (before 2.12)."""
    from torch.distributed.elastic.multiprocessing import api

    timeout_s = int(float(timeout))
    close = api.PContext.close
    if getattr(close, "timeout_s", None) is not None:
        close = close.original

    def close_after(self, death_sig=None, timeout: int = timeout_s) -> None:
        return close(self, death_sig, timeout)

    close_after.timeout_s = timeout_s
    close_after.original = close
    api.PContext.close = close_after
