"""What a person watching a generate() call sees: sequences finished and tokens per second
while it runs. On a terminal a progress bar that leaves no trace when done; in a log file
(stdout not a terminal) a plain line now and then, so the file reads line by line instead
of filling with carriage returns.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

from minisparse.utils import heartbeat

LINE_EVERY_S = heartbeat.EVERY_S  # a log file gets a line this often during a long call
REFRESH_S = 0.5  # the bar is redrawn at most this often


class GenerateProgress:
    def __init__(self, total: int, desc: str = "generate", stream: TextIO | None = None,
                 every_s: float | None = None) -> None:
        self.total, self.desc = total, desc
        self.every_s = LINE_EVERY_S if every_s is None else every_s
        self.stream = stream or sys.stdout
        self.start = self.last = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="seq", leave=False,
                            file=self.stream, dynamic_ncols=True)

    def due(self) -> bool:
        """Whether update() would show anything now (callers skip counting otherwise)."""
        wait = REFRESH_S if self.bar is not None else self.every_s
        return time.perf_counter() - self.last >= wait

    def update(self, finished: int, tokens: int) -> None:
        """finished of total sequences done, tokens generated so far."""
        now = time.perf_counter()
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(finished - self.bar.n)
            self.bar.set_postfix_str(f"{tokens} tok, {rate:.0f} tok/s", refresh=True)
        else:
            print(f"  {self.desc}: {finished}/{self.total} sequences finished, {tokens} "
                  f"tokens, {rate:.0f} tok/s, {now - self.start:.0f} s", file=self.stream,
                  flush=True)
            heartbeat.noted()  # the phase's heartbeat need not speak as well

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
