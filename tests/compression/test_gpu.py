"""The batched CUDA path against the per-sequence CPU path (skipped without CUDA).

Run on a GPU machine with `python -m pytest tests/compression/test_gpu.py -q -s`; -s shows
one agreement line per case. In bfloat16 the cosine similarities are rounded to bf16 on
both devices, but GPU and CPU matmuls accumulate in different orders, so a similarity
sitting on R-KV's threshold, or two scores a rounding apart, may flip: such rows are
judged by their float64 scores with a tolerance, and the exact-agreement rate is printed.
"""
from __future__ import annotations

import pytest
import torch

from minisparse.compression import RKV
from minisparse.config.schema import CompressConfig

from . import reference
from .helpers import make_inputs, make_rule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BUDGET, WINDOW, H_KV, GROUP, DIM = 512, 8, 2, 8, 128


def qwen_like_batch(rows: int, dtype: torch.dtype, seed: int = 0):
    """Rows shaped like Qwen2.5-3B layers (2 KV heads, 16 query heads, head dim 128),
    lengths spread over budget+1 .. budget+160 inside a padded Lmax."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(BUDGET + 1, BUDGET + 161, (rows,), generator=gen)
    lmax = int(lengths.max()) + 7
    keys = torch.randn(rows, H_KV, lmax, DIM, generator=gen).to(dtype)
    queries = torch.empty(rows, H_KV * GROUP, WINDOW, DIM, dtype=dtype)
    for b, n in enumerate(lengths.tolist()):
        k, q = make_inputs(H_KV, GROUP, n, WINDOW, dim=DIM, seed=seed + b, dtype=dtype)
        keys[b, :, :n] = k
        queries[b] = q
    return keys, queries, lengths


RULES = {
    "rkv-per_head": make_rule("rkv", budget=BUDGET, window=WINDOW),
    "rkv-per_layer": make_rule("rkv", budget=BUDGET, window=WINDOW, selection="per_layer"),
    "snapkv-per_head": make_rule("snapkv", budget=BUDGET, window=WINDOW),
    "snapkv-avg-mean": make_rule("snapkv", budget=BUDGET, window=WINDOW, pooling="avg",
                                   group_pooling="mean"),
    "knorm-per_head": make_rule("knorm", budget=BUDGET, window=WINDOW),
    "streaming_llm-per_layer": make_rule("streaming_llm", budget=BUDGET, window=WINDOW,
                                           selection="per_layer"),
}


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_batch_matches_cpu_rows(name, dtype):
    rule = RULES[name]
    keys, queries, lengths = qwen_like_batch(24, dtype)
    gpu = rule.select_batch(keys.cuda(), queries.cuda(), lengths.cuda()).cpu()
    same, worst = 0, 0.0
    for b, n in enumerate(lengths.tolist()):
        k, q = keys[b, :, :n], queries[b]
        cpu = rule.select(k, q)
        same += int((gpu[b] == cpu).all(dim=-1).sum())
        exact = rule.score(k.double(), q.double())
        # float32: rounding-level tolerance; bf16: a few percent of the score scale.
        rel = 1e-4 if dtype == torch.float32 else 0.05
        atol = rel * float(exact.abs().mean())
        worst = max(worst, reference.check_selection(
            gpu[b], exact, n, BUDGET, WINDOW, rule.cfg.selection, atol) / atol)
    # Exact index agreement is reported, not asserted: on max-pooling plateaus that
    # straddle the cut, CPU and GPU topk may break ties differently, both correctly.
    rate = same / (len(lengths) * H_KV)
    print(f"\n[{name} {dtype}] exact head agreement {rate:.1%}, "
          f"worst score gap {worst:.2f} of tolerance")


def test_gpu_chunk_memory_stays_under_cap():
    """Peak scratch memory of a large R-KV batch tracks the chunk cap, and chunking
    does not change the result (up to GEMMs of other batch sizes rounding differently,
    which may swap near-tied tokens in a few heads)."""
    rows, lmax = 512, 640
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(rows, H_KV, lmax, DIM, generator=gen).to("cuda", torch.bfloat16)
    queries = torch.randn(rows, H_KV * GROUP, WINDOW, DIM, generator=gen)
    queries = queries.to("cuda", torch.bfloat16)
    lengths = torch.full((rows,), lmax, device="cuda")
    cap = 256 << 20
    cfg = CompressConfig(algorithm="rkv", budget=BUDGET, window=WINDOW, pooling="avg")
    rule = RKV(cfg, chunk_bytes=cap)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    small = rule.select_batch(keys, queries, lengths)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - base
    print(f"\n[memory] {rows} rows, cap {cap >> 20} MiB: peak scratch {scratch >> 20} MiB "
          f"in chunks of {rule.rows_per_chunk(keys, queries)} rows")
    assert scratch <= 1.25 * cap + small.numel() * 8
    whole = rule.select_batch(keys, queries, lengths, chunk_bytes=64 << 30)
    agree = float((small == whole).all(dim=-1).float().mean())
    print(f"[memory] chunked vs unchunked head agreement {agree:.1%}")
    assert agree >= 0.98
