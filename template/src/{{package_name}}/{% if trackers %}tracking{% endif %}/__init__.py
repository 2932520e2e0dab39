"""Experiment trackers: the run's events as one tracker run across every start."""
