"""scripts/bench_train_phases.py on the CPU: two variants across two gloo ranks, one
report, then a profile on a batch of new lengths."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_two_ranks_report_once(tmp_path):
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "scripts.bench_train_phases", "--config", "tiny_rkv", "--samples", "6",
         "--prompt-len", "12", "--response-len", "20", "--repeats", "1",
         "--variants", "default,default_16k", "--set", "zero_stage=1", "--json", str(out),
         "--profile", "5", "--profile-new-lengths"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("old log-probs vs default") == 1  # rank 0 alone reports
    rows = [line.split() for line in res.stdout.splitlines()
            if line.startswith(("default ", "default_16k "))]
    assert [r[0] for r in rows if len(r) == 11] == ["default", "default_16k"]  # the table
    result = json.loads(out.read_text())
    # the same weights and packed passes: the budgets change the micro-batches, not the values
    assert result["compare"] == {"default": 0.0, "default_16k": 0.0}
    runs = {r["variant"]: r for r in result["runs"]}
    assert set(runs) == {"default", "default_16k"}
    for r in runs.values():
        assert r["time/logprobs_s"] > 0 and r["time/update_s"] > 0
        assert r["train/micro_batches"] >= 1
    # the last variant profiled, each phase once, by rank 0 (no GPU: the host's table only)
    for label in ("logprobs", "update"):
        assert res.stdout.count(f"--- default_16k {label}: kernels 0.00 s of ") == 1
        assert res.stdout.count(f"--- default_16k {label}: where the host's time goes") == 1
