"""Failures other than preemptions: exit records of each start, the step watchdog, the
no-progress guard, stragglers."""
