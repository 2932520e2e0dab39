"""Process plumbing every part shares: process group, collectives, exit statuses, events."""
