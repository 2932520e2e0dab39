"""Checkpoint performance against what the machine allows, measured in one run.

The command `python -m <package>.bench`; its code and usage are in `tools/bench.py`.
"""

import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
