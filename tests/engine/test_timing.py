"""PhaseTimer: per-region device time from event pairs read without a sync per step, and
kept bounded over a long generate() (finished pairs are folded in as they pile up)."""
from __future__ import annotations

import pytest
import torch

from minisparse.engine import timing


class FakeEvent:
    """A CUDA event stand-in: 'runs' when the test says so; 2 ms between paired events."""
    clock = 0
    finished_up_to = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        FakeEvent.clock += 1
        self.t = FakeEvent.clock

    def query(self) -> bool:
        return self.t <= FakeEvent.finished_up_to

    def synchronize(self) -> None:
        FakeEvent.finished_up_to = max(FakeEvent.finished_up_to, self.t)

    def elapsed_time(self, end: "FakeEvent") -> float:
        return 2.0 * (end.t - self.t)


def test_cuda_regions_fold_finished_pairs_and_sum_exactly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing, "_FOLD_AT", 100)
    timer = timing.PhaseTimer(torch.device("cuda"))
    for i in range(1000):
        with timer.region("decode"):
            pass
        if i % 50 == 0:
            FakeEvent.finished_up_to = FakeEvent.clock  # the device caught up
        assert len(timer.pending["decode"]) <= 100
    with timer.region("compress"):
        pass
    seconds = timer.seconds()
    assert seconds == {"decode": pytest.approx(1000 * 2e-3), "compress": pytest.approx(2e-3)}
    assert not timer.pending["decode"]


def test_cpu_regions_are_wall_time():
    timer = timing.PhaseTimer(torch.device("cpu"))
    with timer.region("prefill"):
        sum(range(10000))
    assert timer.seconds()["prefill"] > 0
