"""This process's script as the user typed it, for a command a message gives them to copy."""

from __future__ import annotations

import os
import shlex
import sys


def this_script_command() -> str:
    """This process's script and arguments as typed (`examples/train.py --lr 1e-4`), for a command
    to copy; `train.py` where there is no script file (`python -c`, a notebook kernel's launcher is
    one, but its arguments are the kernel's)."""
    script = sys.argv[0] if sys.argv else ""
    if not os.path.isfile(script) or "ipykernel" in os.path.basename(script):
        return "train.py"
    return shlex.join(sys.argv)
