"""Restart training from the newest complete checkpoint, on this or another number of GPUs.

The command `python -m <package>.resume`; its code and usage are in `launch/supervisor.py`.
"""

import sys

if __name__ == "__main__":
    from .preemption import early

    early.hold()  # a stop signal during the imports below is kept for the stop, not fatal
    from .launch.supervisor import main

    sys.exit(main())
