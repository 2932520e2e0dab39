"""Train, resuming from the newest complete checkpoint when there is one.

The command `python -m <package>.train`; its code and usage are in `loop/job.py`.
"""

import sys

from .loop.job import main

if __name__ == "__main__":
    sys.exit(main())
