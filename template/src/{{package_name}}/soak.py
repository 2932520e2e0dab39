"""Train under a seeded stream of faults and hold the plan's badput against the ledger's.

The command `python -m <package>.soak`; its code and usage are in `ledger/soak.py`."""

from .ledger.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
