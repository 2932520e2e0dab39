"""The checkpoint interval plan on the command line.

The command `python -m <package>.plan`; its code and usage are in `tools/plan.py`."""

from .tools.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
