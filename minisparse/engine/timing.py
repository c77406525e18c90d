"""Device time of code regions without synchronizing the step loop.

The engine's only sync per step is reading the sampled tokens; timing a region with
torch.cuda.synchronize() would add one more and change what it measures. A PhaseTimer
records a pair of CUDA events around each region (on the current stream) and reads them
once at the end, so `seconds()` is the stream time from each region's start to its end.
On the CPU it is plain wall time.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

_FOLD_AT = 1024  # pending pairs of one region before the finished ones are folded in


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: dict[str, list[tuple]] = defaultdict(list)
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        if not self.cuda:
            start = time.perf_counter()
            yield
            self.totals[name] += time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        pairs = self.pending[name]
        pairs.append((start, end))
        if len(pairs) >= _FOLD_AT:  # a long generate(): fold the finished pairs in
            self._fold(name, wait=False)

    def seconds(self) -> dict[str, float]:
        """Seconds per region name so far (waits for the recorded events)."""
        for name in self.pending:
            self._fold(name, wait=True)
        return dict(self.totals)

    def _fold(self, name: str, wait: bool) -> None:
        """Add the pairs of `name` whose end has run (all of them, waiting, if wait) to
        its total, in recording order."""
        pairs = self.pending[name]
        done = 0
        for start, end in pairs:
            if not wait and not end.query():
                break
            end.synchronize()
            self.totals[name] += start.elapsed_time(end) / 1e3
            done += 1
        del pairs[:done]
