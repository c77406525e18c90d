"""scripts/bench_hf_peer.py on the CPU: the peer loop runs, and it computes the same
response log-probs as the trainer's packed pass, so the two time the same work."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from minisparse.models.attention import use_attention
from minisparse.trainer.logprobs import batch_logprobs

REPO = Path(__file__).resolve().parents[1]


def _peer():
    from scripts import bench_hf_peer

    return bench_hf_peer


def test_the_loop_runs_and_reports_each_repeat(tmp_path):
    out = tmp_path / "peer.json"
    res = subprocess.run(
        [sys.executable, "-m", "scripts.bench_hf_peer", "--model", "tiny", "--stacks", "hf", "--samples", "4",
         "--prompt-len", "8", "--response-len", "24", "--seqs-per-mb", "2", "--repeats", "2",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["stack"], r["repeat"], r["tokens"]) for r in rows] == [("hf", 0, 128), ("hf", 1, 128)]
    assert all(r["logprobs_s"] > 0 and r["update_fwd_bwd_s"] > 0 for r in rows)
    assert "logprobs_mfu" not in rows[0]  # no peak on a CPU, so no MFU


def test_the_peer_log_probs_are_the_trainers():
    peer = _peer()
    model = peer.build_model("tiny", "sdpa", torch.device("cpu")).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=g)
    prompt_len = 6
    with torch.no_grad():
        theirs = peer.plain_logprobs(model, ids, prompt_len)
    use_attention(model, "varlen")
    ours = batch_logprobs(model, [r[:prompt_len].tolist() for r in ids],
                          [r[prompt_len:].tolist() for r in ids], width=14, max_tokens=40)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
