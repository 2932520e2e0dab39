"""Tokenize text or JSONL files into the token directory that ``data.kind: tokens`` reads.

The command `python -m <package>.prepare_data`; its code and usage are in tools/prepare_data.py."""

from .tools.prepare_data import main

if __name__ == "__main__":
    raise SystemExit(main())
