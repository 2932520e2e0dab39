"""Failures other than preemptions: exit records, step watchdog, no-progress guard, stragglers."""
