"""Train, resuming from the newest complete checkpoint when there is one.

The command `python -m <package>.train`; its code and usage are in `loop/job.py`.
"""

import sys

if __name__ == "__main__":
    from .preemption import early

    early.hold()  # a stop signal during the imports below is kept for the stop, not fatal
    from .loop.job import main

    sys.exit(main())
