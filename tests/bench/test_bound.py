"""The decode memory bound the bench reports: weight and KV byte counts from the real
model, per-step cache lengths from the engine, and the arithmetic that joins them."""
from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import build
from minisparse.bench.run import parse_args, run
from minisparse.bench.bound import decode_bound, decode_roofline, weight_bytes_per_step
from minisparse.models.loading import kv_bytes_per_token
from minisparse.engine.sequence import GenerateStats


def test_weight_bytes_count_tied_head_once_and_skip_untied_embedding():
    qwen2, llama = build("qwen2"), build("llama")  # tied / untied embeddings, float32
    n_qwen = sum(p.numel() for p in qwen2.parameters())  # parameters() lists a tied one once
    assert weight_bytes_per_step(qwen2) == 4 * n_qwen
    n_llama = sum(p.numel() for p in llama.parameters())
    embed = llama.model.embed_tokens.weight.numel()
    assert weight_bytes_per_step(llama) == 4 * (n_llama - embed)
    assert weight_bytes_per_step(qwen2.to(torch.bfloat16)) == 2 * n_qwen


def test_kv_bytes_per_token():
    llama = build("llama")  # 2 layers, 2 KV heads, head_dim 16
    assert kv_bytes_per_token(llama.config, torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    qwen2 = build("qwen2")  # head_dim = 64 / 4
    assert kv_bytes_per_token(qwen2.config, torch.float32) == 2 * 2 * 2 * 16 * 4


def test_decode_bound_arithmetic():
    s = GenerateStats(tokens_per_s=500.0, decode_steps=10, decode_tokens=40,
                      decode_kv_tokens=4000)
    out = decode_bound(s, weight_bytes=1000, kv_token_bytes=10, bandwidth=1e5)
    bound_s = (10 * 1000 + 4000 * 10) / 1e5  # 0.5 s for 40 tokens
    assert out["bound_s"] == pytest.approx(bound_s)
    assert out["bound_tokens_per_s"] == pytest.approx(80.0)
    assert out["bound_fraction"] == pytest.approx(500.0 / 80.0)
    with pytest.raises(ValueError, match="bandwidth"):
        decode_bound(s, 1, 1, 0.0)
    assert decode_bound(GenerateStats(), 1, 1, 1.0)["bound_tokens_per_s"] == 0.0


def test_roofline_takes_the_longer_of_weight_read_and_gemm_arithmetic():
    s = GenerateStats(tokens_per_s=50.0, decode_steps=10, decode_tokens=40,
                      decode_kv_tokens=4000)
    # 1000 bytes = 500 bf16 weights; reads: 10 * 1000 / 1e5 = 0.1 s, K/V 0.4 s
    slow = decode_roofline(s, 1000, 2, 10, bandwidth=1e5, flops_per_s=1e6)
    # arithmetic 2 * 500 * 40 / 1e6 = 0.04 s < 0.1 s read: the memory bound
    assert slow["roofline_tokens_per_s"] == pytest.approx(
        decode_bound(s, 1000, 10, 1e5)["bound_tokens_per_s"])
    fast = decode_roofline(s, 1000, 2, 10, bandwidth=1e5, flops_per_s=1e5)
    # arithmetic 0.4 s > 0.1 s read: 40 tokens in 0.4 + 0.4 s
    assert fast["roofline_tokens_per_s"] == pytest.approx(50.0)
    assert fast["roofline_fraction"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="flops_per_s"):
        decode_roofline(s, 1, 1, 1, 1.0, 0.0)


def test_bench_json_has_bound_fields(tmp_path, tiny_path):
    path = tmp_path / "bench.json"
    args = parse_args(["--model", str(tiny_path), "--device", "cpu", "--dtype", "float32",
                       "--batch", "2", "--prompt-len", "8", "--max-new-tokens", "6",
                       "--repeats", "1",
                       "--warmup", "0", "--copy-gbs", "50", "--json", str(path)])
    run(args)
    saved = json.loads(path.read_text())
    assert saved["bound_tokens_per_s"] > 0
    assert "roofline_tokens_per_s" not in saved  # no GEMM throughput measured on the CPU
    assert saved["decode_s"] > 0 and saved["compress_events"] == 0
    assert saved["host_s"] == pytest.approx(
        saved["wall_s"] - saved["decode_s"] - saved["prefill_s"] - saved["compress_s"], abs=1e-6)
    assert saved["bound_fraction"] == pytest.approx(
        saved["tokens_per_s"] / saved["bound_tokens_per_s"])
