"""Restart training from the newest complete checkpoint, on this or another number of GPUs.

The command `python -m <package>.resume`; its code and usage are in `launch/supervisor.py`."""

import sys

if __name__ == "__main__":  # a stop signal during the imports below is kept, not fatal
    from .preemption import early

    early.hold()
    from .launch.zygote import ahead

    zygote = ahead(sys.argv[1:])   # warm start: its imports beside this command's own

from .launch.supervisor import main  # after the hold

if __name__ == "__main__":
    try:
        status = main(zygote=zygote)
    finally:
        if zygote is not None:
            zygote.stop()
    sys.exit(status)
