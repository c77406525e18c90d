"""A long phase with output to a file says it is still running at least every EVERY_S;
never when another progress line spoke lately, never on a terminal."""
import sys
import time

import torch

import minisparse.utils.heartbeat as heartbeat
from minisparse.engine.progress import GenerateProgress
from minisparse.trainer.memory.phases import phase


def test_a_quiet_phase_gets_a_line_every_interval(monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.1)
    metrics: dict[str, float] = {}
    with phase("update", metrics, torch.device("cpu")):
        time.sleep(0.35)
    lines = capsys.readouterr().out.splitlines()  # pytest's capture is not a terminal
    assert 2 <= len(lines) <= 4 and all(line.startswith("  [update] still running, ")
                                        for line in lines)
    assert "time/update_s" in metrics
    time.sleep(0.2)
    assert capsys.readouterr().out == ""  # the thread stopped with the phase


def test_no_heartbeat_while_progress_lines_come(monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.2)
    shown = GenerateProgress(4, desc="rollout", stream=sys.stdout, every_s=0.0)
    with heartbeat.heartbeat("rollout"):
        for i in range(8):
            shown.update(i // 2, 10 * i)
            time.sleep(0.05)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("  rollout: ") for line in lines)


def test_no_heartbeat_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.05)
    monkeypatch.setattr(heartbeat, "wanted", lambda: False)  # stdout a terminal
    with heartbeat.heartbeat("update"):
        time.sleep(0.2)
    assert capsys.readouterr().out == ""
