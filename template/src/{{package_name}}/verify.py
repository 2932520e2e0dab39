"""Check checkpoints against the checksums their commit.json recorded.

The command `python -m <package>.verify`; its code and usage are in `tools/verify.py`."""

from .tools.verify import main

if __name__ == "__main__":
    raise SystemExit(main())
