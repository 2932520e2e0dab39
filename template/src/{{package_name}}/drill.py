"""The interruption drill: lose a run the hard way, resume it, and check that nothing changed.

The command `python -m <package>.drill`; its code and usage are in `tools/drill.py`."""

import sys

from .tools.drill import main

if __name__ == "__main__":
    sys.exit(main())
