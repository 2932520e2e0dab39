"""The interruption drill: lose a run the hard way, resume it, and check that nothing changed.

The command `python -m <package>.drill`; its code and usage are in `tools/drill.py`."""

from .tools.drill import main

if __name__ == "__main__":
    raise SystemExit(main())
