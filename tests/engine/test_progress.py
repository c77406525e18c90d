"""A generate() call shows sequences finished and tokens per second while it runs; in a
log file (not a terminal) as whole lines, never carriage-return bars."""
import io

import pytest

import minisparse.engine.progress as progress
from minisparse.config.schema import EngineConfig
from minisparse.engine import LLMEngine, SamplingParams
from minisparse.engine.progress import GenerateProgress
from engine_helpers import Tok


def test_log_file_gets_whole_lines_with_counts_and_rate():
    out = io.StringIO()
    shown = GenerateProgress(8, desc="rollout", stream=out, every_s=0.0)
    assert shown.due()
    shown.update(3, 120)
    shown.close()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    assert text.startswith("  rollout: 3/8 sequences finished, 120 tokens, ")
    assert " tok/s, " in text


def test_engine_reports_while_generating(qwen2, capsys, monkeypatch):
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)  # a line at every step
    engine = LLMEngine(qwen2, Tok(), EngineConfig(page_size=4, kv_cpu_memory_gb=0.01,
                                                  cuda_graphs=False))
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=0, ignore_eos=True)
    engine.generate([[5, 6, 7], [8, 9]], params, progress=True)
    lines = capsys.readouterr().out.splitlines()  # pytest's capture is not a terminal
    assert lines and all(line.startswith("  generate: ") for line in lines)
    counts = [int(line.split()[1].split("/")[0]) for line in lines]
    assert counts == sorted(counts) and counts[-1] == 4  # finished sequences only grow
    assert all(line.split()[1].endswith("/4") for line in lines)
    engine.generate([[5, 6, 7]], params)  # progress off: silent
    assert capsys.readouterr().out == ""
