"""The fixed-shape decode path of cuda_graph.DecodeGraphs, run eagerly on CPU: padding rows
(scratch page) must not change any real sequence's tokens, dense or compressed."""
from __future__ import annotations

import torch

from engine_helpers import make_engine, prompts
from minisparse.compression import max_cache_tokens
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams
from minisparse.engine.cuda_graph import DecodeGraphs, batch_buckets


def padded_engine(model, compress=None, **kw):
    engine = make_engine(model, compress, page_size=4, **kw)
    bound = max_cache_tokens(compress) if compress else engine.pool.max_model_len
    engine.runner.graphs = DecodeGraphs(engine.lm, engine.pool, bound, use_graphs=False)
    return engine


def test_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(512)[:7] == [1, 2, 4, 8, 16, 32, 64] and batch_buckets(512)[-1] == 512
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_padded_decode_matches_eager(model):
    ps = prompts(5, lo=5, hi=30)  # 5 sequences -> bucket 8, three padding rows
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=2, ignore_eos=True)
    eager = make_engine(model, page_size=4).generate(ps, params)
    padded_engine_ = padded_engine(model)
    calls = []
    real = padded_engine_.runner.graphs.run
    padded_engine_.runner.graphs.run = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    outs = padded_engine_.generate(ps, params)
    assert calls and any(b not in batch_buckets(16) for b in calls)
    for a, b in zip(outs, eager):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_padded_decode_with_compression_and_fallback(qwen2):
    cfg = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel_size=3)
    ps = prompts(3, lo=5, hi=30)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    eager = make_engine(qwen2, cfg, page_size=4).generate(ps, params)
    engine = padded_engine(qwen2, cfg)
    outs = engine.generate(ps, params)
    assert engine.last_stats.compressions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    graphs = engine.runner.graphs
    assert graphs.fits(3, max_cache_tokens(cfg)) and not graphs.fits(3, max_cache_tokens(cfg) + 1)
