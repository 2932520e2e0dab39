"""Launching: the torchrun command line and the supervisor behind `python -m <package>.resume`."""
