"""Where the machine time of a run went, over every start, and the measured MTBI.

The command `python -m <package>.goodput`; its code and usage are in `ledger/command.py`."""

from .ledger.command import main

if __name__ == "__main__":
    raise SystemExit(main())
