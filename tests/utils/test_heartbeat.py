"""A long phase with output to a file says it is still running at least every EVERY_S;
never when another progress line spoke lately, never on a terminal. The tests wait for
the heartbeat thread's own acts (a line, a look at the clock), never for a guessed time,
so a busy machine changes how long they take, not what they see."""
import sys
import threading
import time

import pytest
import torch

import minisparse.utils.heartbeat as heartbeat
from minisparse.engine.progress import GenerateProgress
from minisparse.trainer.measure import phase

LONG_S = 300.0  # bounds a wait for the thread; only a broken heartbeat gets near it


def _beating() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("heartbeat-")]


def test_a_quiet_phase_gets_a_line_every_interval(monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.1)
    beats, third = [], threading.Event()
    noted = heartbeat.noted

    def counted() -> None:  # the heartbeat calls it after each of its lines
        beats.append(time.monotonic())  # before noted(): the next beat waits from there
        noted()
        if len(beats) == 3:
            third.set()

    monkeypatch.setattr(heartbeat, "noted", counted)
    metrics: dict[str, float] = {}
    with phase("update", metrics, torch.device("cpu")):
        assert third.wait(LONG_S)
    lines = capsys.readouterr().out.splitlines()  # pytest's capture is not a terminal
    assert len(lines) == len(beats) >= 3
    assert all(line.startswith("  [update] still running, ") for line in lines)
    # never sooner than the interval after the one before (later when the machine is busy)
    assert all(b - a >= 0.1 for a, b in zip(beats, beats[1:]))
    assert "time/update_s" in metrics
    assert not _beating() and capsys.readouterr().out == ""  # it stopped with the phase


class _Clock:
    """The heartbeat module's time: moved by hand; counts the heartbeat thread's looks."""

    def __init__(self) -> None:
        self.now, self.looks = 1000.0, 0
        self.looked = threading.Condition()

    def monotonic(self) -> float:
        if threading.current_thread().name.startswith("heartbeat-"):
            with self.looked:
                self.looks += 1
                self.looked.notify_all()
        return self.now

    def next_look(self) -> None:
        """Wait until the heartbeat thread has looked at the clock once more."""
        with self.looked:
            seen = self.looks
            assert self.looked.wait_for(lambda: self.looks > seen, LONG_S)


@pytest.mark.parametrize("progress", [True, False])
def test_no_heartbeat_while_progress_lines_come(monkeypatch, capsys, progress):
    """Progress lines every 0.05 s of the heartbeat's clock and an interval of 0.2 s: the
    heartbeat looks after each and stays quiet. Without them, it speaks (the check)."""
    clock = _Clock()
    monkeypatch.setattr(heartbeat, "time", clock)
    monkeypatch.setattr(heartbeat, "_last_line", 0.0)  # another test's line, on the real clock
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.2)  # also how often it looks, in real time
    shown = GenerateProgress(4, desc="rollout", stream=sys.stdout, every_s=0.0)
    with heartbeat.heartbeat("rollout"):
        for i in range(8):
            clock.now += 0.05
            if progress:
                shown.update(i // 2, 10 * i)
            clock.next_look()
    lines = capsys.readouterr().out.splitlines()
    if progress:
        assert len(lines) == 8 and all(line.startswith("  rollout: ") for line in lines)
    else:
        assert lines and all(line.startswith("  [rollout] still running, ") for line in lines)


def test_no_heartbeat_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.05)
    monkeypatch.setattr(heartbeat, "wanted", lambda: False)  # stdout a terminal
    with heartbeat.heartbeat("update"):
        assert not _beating()  # no thread to speak
        time.sleep(0.2)
    assert capsys.readouterr().out == ""
