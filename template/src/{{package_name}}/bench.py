"""Checkpoint performance against what the machine allows, measured in one run.

The command `python -m <package>.bench`; its code and usage are in `tools/bench.py`."""

from .runtime import lifeline

if __name__ == "__main__":
    lifeline.hand_down()      # the processes it starts end with it
elif __name__ == "__mp_main__":  # DCP's checkpoint process, spawned by this command
    from .preemption.early import HELD

    lifeline.follow_parent(stop_signals=HELD)   # a stop is the worker's to decide

from .tools.bench import main  # after the parent watch

if __name__ == "__main__":
    raise SystemExit(main())
