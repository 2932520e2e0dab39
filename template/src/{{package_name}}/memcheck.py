"""Memory check: resident memory of a training run does not grow with the token data's size.

The command `python -m <package>.memcheck`; its code and usage are in `tools/memcheck.py`."""

from .tools.memcheck import main

if __name__ == "__main__":
    raise SystemExit(main())
