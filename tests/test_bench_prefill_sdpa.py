"""scripts/bench_prefill_sdpa.py on the CPU: each arm's run takes the prefill kernels it
names (and the engine's choice is back after it), and the loop reports each run."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import torch

import minisparse.engine.layers.attention as attention
from minisparse.engine.sequence import GenerateStats
from scripts import bench_prefill_sdpa as bench

REPO = Path(__file__).resolve().parents[1]


class _Engine:
    """Records what a prefill on CUDA would run, as generate() sees it."""

    device = torch.device("cpu")

    def __init__(self):
        self.seen = []

    def generate(self, prompts, sp):
        self.seen.append(attention.prefill_sdpa(torch.device("cuda")))
        self.last_stats = GenerateStats(steps=7, decode_steps=5, prefill_s=0.1)


def test_each_arm_runs_its_own_prefill_kernels():
    engine, chosen = _Engine(), attention.prefill_sdpa
    for arm in bench.ARMS:
        r = bench.run_once(engine, [[1, 2]], None, arm)
        assert (r["arm"], r["prefill_steps"]) == (arm, 2)
        assert abs(r["prefill_ms_per_step"] - 50.0) < 1e-9
    torch_ctx, engine_ctx = engine.seen
    assert isinstance(torch_ctx, contextlib.nullcontext)  # torch's own pick: cuDNN first
    assert not isinstance(engine_ctx, contextlib.nullcontext)
    assert attention.prefill_sdpa is chosen


def test_the_loop_runs_and_reports_each_run(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + {2 * i}?" + " Think." * i,
                                        "label": str(3 * i)}) + "\n" for i in range(1, 23)))
    out = tmp_path / "runs.json"
    res = subprocess.run(
        [sys.executable, "-m", "scripts.bench_prefill_sdpa", "--model", "tiny", "--config",
         "tiny_rkv", "--data", str(rows), "--prompts", "3", "--pairs", "2",
         "--samples-per-prompt", "2", "--max-new-tokens", "12", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["pair"], r["arm"]) for r in runs] == [(0, "torch"), (0, "engine"),
                                                     (1, "torch"), (1, "engine")]
    for a, b in (runs[:2], runs[2:]):  # one kernel on the CPU: the same rollout twice
        assert a["prefill_tokens"] == b["prefill_tokens"] > 0
        assert a["generated_tokens"] == b["generated_tokens"] > 0
    assert runs[0]["prefill_tokens"] != runs[2]["prefill_tokens"]  # fresh prompts a pair
    assert "torch: median rollout" in res.stdout and "engine: median rollout" in res.stdout


def test_too_few_rows_is_a_clear_error(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n")  # 1 of 20
    res = subprocess.run(
        [sys.executable, "-m", "scripts.bench_prefill_sdpa", "--model", "tiny", "--config",
         "tiny_rkv", "--data", str(rows), "--prompts", "2", "--pairs", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode != 0
    assert "has 1 usable row(s); the runs need 20 (--prompts x --pairs" in res.stderr
