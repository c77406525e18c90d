"""A pool too small for the batch: sequences are preempted and recomputed, every sample
still completes, greedy tokens equal a roomy pool's, and no page leaks."""
from __future__ import annotations

import torch

from engine_helpers import make_engine, prompts
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams

PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K+V, 2 layers, page_size 4, 2 KV heads, D 16, fp32


def small_engine(model, pages: int, **kw):
    """An engine whose pool has exactly `pages` pages (plus the scratch page)."""
    return make_engine(model, page_size=4, kv_memory_gb=(pages + 1) * PAGE_BYTES / 2**30, **kw)


def test_small_pool_preempts_and_matches_roomy_pool(model):
    ps = prompts(6, lo=8, hi=20)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    roomy = make_engine(model, page_size=4).generate(ps, params)
    engine = small_engine(model, 24)
    assert engine.pool.num_pages == 24
    outs = engine.generate(ps, params)
    assert engine.last_stats.preemptions > 0
    assert engine.last_stats.peak_pages_used <= 24
    assert engine.allocator.num_free == 24
    for a, b in zip(outs, roomy):
        assert a.finish_reason == "length" and a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_sampled_tokens_survive_preemption(qwen2):
    ps = prompts(5, lo=8, hi=20)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=30, seed=7, ignore_eos=True)
    roomy = make_engine(qwen2, page_size=4).generate(ps, params)
    engine = small_engine(qwen2, 20, max_prefill_tokens=8)
    outs = engine.generate(ps, params)
    assert engine.last_stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_compressed_sequences_complete_in_a_small_pool_without_preemption(qwen2):
    """Compressed caches stop at budget + divide_length = 24 entries (6 pages), so the
    scheduler admits only as many as the 16 pages hold at that size, two, and none is
    ever preempted; optimistic admission (the pool's free pages alone) preempted here."""
    cfg = CompressConfig(algorithm="snapkv", budget=16, window=4, divide_length=8, kernel_size=3)
    engine = small_engine(qwen2, 16, compress=cfg)
    running = []
    real = engine._decode
    engine._decode = lambda sched, *a: running.append(len(sched.running)) or real(sched, *a)
    outs = engine.generate(prompts(6, lo=8, hi=20), SamplingParams(max_new_tokens=80, seed=1,
                                                                  ignore_eos=True))
    stats = engine.last_stats
    assert stats.preemptions == 0 and stats.compressions > 0
    assert max(running) == 2 and stats.peak_pages_used <= 16
    assert all(o.finish_reason == "length" and len(o.token_ids) == 80 for o in outs)
    assert engine.allocator.num_free == 16


def test_sequence_larger_than_pool_aborts_alone(qwen2):
    engine = small_engine(qwen2, 4)  # 16 token slots
    outs = engine.generate([[5] * 10, [6] * 30], SamplingParams(temperature=0, max_new_tokens=20,
                                                               ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert len(outs[0].token_ids) == 16 + 1 - 10 and outs[1].token_ids == []
    assert engine.allocator.num_free == 4


def _check_page_table_after_each_step(engine):
    """Wrap engine._step: after every step, each running sequence's page-table row starts
    with its page list (the engine writes only the new tail of a row)."""
    real = engine._step
    checked = []

    def step(sched, *a):
        out = real(sched, *a)
        for seq in sched.running:
            assert seq.synced_pages == len(seq.pages)
            row = engine.pool.page_table[seq.slot, :len(seq.pages)].tolist()
            assert row == seq.pages
        checked.append(len(sched.running))
        return out

    engine._step = step
    return checked


def test_page_table_rows_follow_growth_preemption_and_compaction(qwen2):
    ps = prompts(6, lo=8, hi=20)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    cfg = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel_size=3)
    for compress in (None, cfg):
        engine = small_engine(qwen2, 26, compress=compress, max_prefill_tokens=8)
        checked = _check_page_table_after_each_step(engine)
        engine.generate(ps, params)
        assert sum(checked) > 0
        if compress is None:
            assert engine.last_stats.preemptions > 0
        else:
            assert engine.last_stats.compressions > 0
