"""Train, resuming from the newest complete checkpoint when there is one.

The command `python -m <package>.train`; its code and usage are in `loop/job.py`."""

from .runtime import lifeline

if __name__ == "__main__":  # a stop signal during the imports below is kept, not fatal
    from .preemption import early

    early.hold()
    from .launch import warm

    warm.start_if_asked()     # forked from resume's zygote, if there is one: no return
    lifeline.hand_down()      # the processes it starts end with it
elif __name__ == "__mp_main__":  # DCP's checkpoint process, spawned by this command
    from .preemption.early import HELD

    lifeline.follow_parent(stop_signals=HELD)   # a stop is the worker's to decide

from .loop.job import main  # after the hold

if __name__ == "__main__":
    raise SystemExit(main())
