"""Where the machine time of a run went, over every start, and the measured MTBI.

The command `python -m <package>.goodput`; its code and usage are in `ledger/command.py`."""

import sys

from .ledger.command import main

if __name__ == "__main__":
    sys.exit(main())
