"""The interval plan's assumed shares of interruptions, defined once: the defaults of the
config's ``plan:`` section (schema.py) and of the planner's inputs (interval/formulas.py).
Here, below both, so that the config never imports the planner."""

CRASH_SHARE = 0.5  # assumed share of interruptions that are crashes (restarted in place)
NODE_LOSS_SHARE = 0.2  # assumed share of interruptions that take one node (its memory) away
# c + ν may exceed 1 by this much (0.7 + 0.3 is not exactly 1 in floats).
SHARE_SLACK = 1e-9
