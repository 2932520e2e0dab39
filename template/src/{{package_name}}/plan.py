"""The checkpoint interval plan on the command line.

The command `python -m <package>.plan`; its code and usage are in `interval/command.py`.
"""

import sys

from .interval.command import main

if __name__ == "__main__":
    sys.exit(main())
