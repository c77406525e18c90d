"""A line at least every EVERY_S seconds while a long phase runs, for a run whose output
goes to a file: there no progress bar draws, and a quiet log cannot be told from a hung
run (a first rollout printed nothing for three minutes). Whatever prints its own progress
lines (engine/progress.py) calls `noted()`, so the heartbeat speaks only into silence.
On a terminal it stays off: the bars show that the run is alive, and a line from another
thread would tear them.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# tests and impatient users lower it through the environment
EVERY_S = float(os.environ.get("MINISPARSE_HEARTBEAT_S", "30"))

_last_line = 0.0  # time.monotonic() of the last progress line printed


def noted() -> None:
    """A progress line was just printed: the heartbeat waits EVERY_S from now."""
    global _last_line
    _last_line = time.monotonic()


def wanted() -> bool:
    """Whether heartbeats print here: output to a file or pipe, not a terminal."""
    return not sys.stdout.isatty()


@contextmanager
def heartbeat(name: str, enabled: bool = True) -> Iterator[None]:
    """'  [name] still running, N s' whenever EVERY_S seconds passed with no line, while
    the block runs (a daemon thread; stopped when the block ends, however it ends)."""
    if not enabled or not wanted():
        yield
        return
    start, stop = time.monotonic(), threading.Event()

    def beat() -> None:
        every = EVERY_S
        while not stop.wait(min(every, 1.0)):
            now = time.monotonic()
            if now - max(start, _last_line) >= every:
                print(f"  [{name}] still running, {now - start:.0f} s", flush=True)
                noted()

    thread = threading.Thread(target=beat, name=f"heartbeat-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
