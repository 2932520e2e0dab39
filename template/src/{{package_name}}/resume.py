"""Restart training from the newest complete checkpoint, on this or another number of GPUs.

The command `python -m <package>.resume`; its code and usage are in `launch/supervisor.py`.
"""

import sys

from .launch.supervisor import main

if __name__ == "__main__":
    sys.exit(main())
