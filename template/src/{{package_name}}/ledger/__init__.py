"""Where the machine time went: the interruption history kept with the checkpoints, the
goodput ledger over every start of a run, and the measured MTBI."""
