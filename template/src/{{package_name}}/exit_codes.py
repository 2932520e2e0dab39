"""The exit statuses of every command, defined once (docs/PREEMPTION.md explains them).

A scheduler reads these: 0 and ``BAD_INPUT`` end the job; ``preemption.exit_code``
(``PREEMPTED``, 75 by default) and ``NOT_SAVED`` ask for another run, which resumes
from the newest committed checkpoint.
"""

OK = 0             # finished (train, resume), passed (drill, verify)
FAILED = 1         # crashed, or a check failed (drill, verify)
BAD_INPUT = 2      # refused before running: configuration, arguments, a task breaking its contract
NOT_SAVED = 73     # training ended but its last state is not in a committed checkpoint: run again
PREEMPTED = 75     # default of preemption.exit_code: EX_TEMPFAIL, "run me again"
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): stopped by the user, the state saved first
