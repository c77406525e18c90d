"""Ctrl-C in a command (train.py, eval.py, the downloader): exit 130, what a shell reports
for a Ctrl-C (128 + SIGINT), and one line saying what is kept, never a traceback.

While a command's libraries import (seconds: torch, transformers) there is nothing to
keep, so a Ctrl-C then writes its line and ends the process at once. `ready()` hands
Ctrl-C back to Python (KeyboardInterrupt), which the command's main catches to say
what it kept. This module imports nothing heavy: it is the first a command loads.
"""
from __future__ import annotations

import os
import signal

CTRL_C_EXIT = 128 + signal.SIGINT


def stop_at_once(line: str) -> None:
    """Until ready(): a Ctrl-C writes `line` to stderr (none where it is empty: a process
    that does not speak for the run) and exits 130 at once."""
    def stop(signum: int, frame: object) -> None:
        if line:
            os.write(2, (line + "\n").encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, stop)


def ready() -> None:
    """From here a Ctrl-C raises KeyboardInterrupt, for main to catch."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
