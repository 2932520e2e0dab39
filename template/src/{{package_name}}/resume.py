"""Restart training from the newest complete checkpoint, on this or another number of GPUs.

The command `python -m <package>.resume`; its code and usage are in `launch/supervisor.py`.
"""

import sys

if __name__ == "__main__":  # a stop signal during the imports below is kept, not fatal
    from .preemption import early

    early.hold()

from .launch.supervisor import main  # after the hold

if __name__ == "__main__":
    sys.exit(main())
