"""Process-level plumbing every part shares: the process group and its collectives, the
exit statuses, the event log."""
