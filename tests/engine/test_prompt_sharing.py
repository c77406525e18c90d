"""The n samples of a prompt prefill it once (engine.share_prompt_cache): the samples'
tokens and log-probs are those of engines that prefill every sample, the prefill skips
exactly the shared tokens, dense samples (and compressed ones under keep_prompt) hold the
prompt pages once, and no page leaks."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import make_engine, prompts
from minisparse.compression import max_cache_tokens
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams
from test_preemption import small_engine

COMPRESS = {
    "dense": None,
    "rkv": CompressConfig(algorithm="rkv", budget=24, window=4, divide_length=8),
    "snapkv": CompressConfig(algorithm="snapkv", budget=24, window=4, divide_length=8,
                             kernel_size=3),
    # the prompt is never evicted: compaction writes past it, so its pages are held, not copied
    "rkv_keep_prompt": CompressConfig(algorithm="rkv", budget=24, window=4, divide_length=8,
                                      keep_prompt=True),
}


def _generate(model, compress, share: bool, ps, params, **kw):
    engine = make_engine(model, compress, page_size=4, share_prompt_cache=share, **kw)
    outs = engine.generate(ps, params)
    assert engine.allocator.num_free == engine.allocator.num_pages  # nothing leaked
    assert not any(engine.allocator.refs)
    return engine.last_stats, outs


def _same(outs, ref) -> None:
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", COMPRESS)
def test_shared_prompts_give_the_samples_of_a_full_prefill(model, mode):
    ps = prompts(4, lo=14, hi=24)  # within the budget: no sibling is compacted at once
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=48, seed=3, ignore_eos=True)
    off, ref = _generate(model, COMPRESS[mode], False, ps, params)
    on, outs = _generate(model, COMPRESS[mode], True, ps, params)
    _same(outs, ref)
    window = COMPRESS[mode].window if COMPRESS[mode] else 0
    # every later sample of a prompt takes its whole pages up to the last (window) tokens
    shared = sum(2 * ((len(p) - max(window, 1)) // 4 * 4) for p in ps)
    assert on.shared_prompt_tokens == shared > 0 and off.shared_prompt_tokens == 0
    assert on.prefill_tokens + shared == off.prefill_tokens
    if mode in ("dense", "rkv_keep_prompt"):  # the shared pages are held once
        assert on.peak_pages_used < off.peak_pages_used
    else:
        assert on.peak_pages_used == off.peak_pages_used  # each sample holds its own copy
    if mode != "dense":
        assert on.compressions == off.compressions > 0


@pytest.mark.parametrize("mode", ["rkv", "snapkv"])
def test_a_prompt_longer_than_the_budget_is_prefilled_once(qwen2, mode):
    """A prompt past the budget (24) is compacted right after its prefill, so no sibling
    could copy it: each sample prefilled it whole, one step each. It now stays whole until
    the waiting siblings copied it, and the samples are those of full prefills."""
    cfg = COMPRESS[mode]
    ps = prompts(3, lo=30, hi=40, seed=7)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    off, ref = _generate(qwen2, cfg, False, ps, params)
    on, outs = _generate(qwen2, cfg, True, ps, params)
    _same(outs, ref)
    assert on.compressions == off.compressions and all(o.num_compressions for o in outs)
    # every later sample takes the pages up to the last window tokens
    shared = sum(3 * ((len(p) - cfg.window) // 4 * 4) for p in ps)
    assert on.shared_prompt_tokens == shared
    assert on.prefill_tokens + shared == off.prefill_tokens


def test_held_prompts_are_compacted_before_any_decode_step(qwen2):
    """With 2 slots the siblings of a held prompt cannot all be admitted: the held caches
    are compacted before the first decode step, so no decode step sees a cache past its
    bound, and the later samples prefill their prompts whole."""
    cfg = COMPRESS["rkv"]
    engine = make_engine(qwen2, cfg, page_size=4, max_num_seqs=2)
    bound, real = max_cache_tokens(cfg), engine.runner.launch

    def launch(seqs, sp, inputs):
        assert all(s.cache_len < bound for s in seqs)
        return real(seqs, sp, inputs)
    engine.runner.launch = launch
    ps = prompts(3, lo=30, hi=40, seed=7)
    outs = engine.generate(ps, SamplingParams(n=4, max_new_tokens=20, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 20 and o.num_compressions for o in outs)
    assert not engine.held and engine.allocator.num_free == engine.allocator.num_pages


def test_a_compression_right_after_the_prefill_scores_the_samples_own_queries(qwen2):
    """Prompts 0-3 tokens short of the budget (24): each sample compresses 4 decode steps
    after its prefill (the batch's step 4, divide_length 4), with a query window of 8
    that reaches back into the prompt, past the pages a sibling could give. The shared
    pages stop short of it."""
    cfg = CompressConfig(algorithm="rkv", budget=24, window=8, divide_length=4)
    ps = prompts(4, lo=21, hi=24, seed=6)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5, ignore_eos=True)
    _, ref = _generate(qwen2, cfg, False, ps, params)
    on, outs = _generate(qwen2, cfg, True, ps, params)
    assert on.shared_prompt_tokens == sum((len(p) - 8) // 4 * 4 for p in ps)
    assert all(o.num_compressions == 1 for o in outs)
    _same(outs, ref)


def test_greedy_samples_with_shared_pages_equal_hf_generate(qwen2):
    from engine_helpers import hf_greedy

    ps = prompts(3, lo=10, hi=30, seed=4)
    _, outs = _generate(qwen2, None, True, ps, SamplingParams(n=2, temperature=0,
                                                              max_new_tokens=20,
                                                              ignore_eos=True))
    for i, o in enumerate(outs):
        assert o.token_ids == hf_greedy(qwen2, ps[i // 2], 20)


@pytest.mark.parametrize("mode", ["dense", "rkv", "rkv_keep_prompt"])
def test_shared_prompts_survive_preemption(qwen2, mode):
    """Dense samples equal a roomy pool's. A preempted compressed sample is recomputed from
    its tokens and compressed anew (it keeps other entries than it did), so those are
    checked for completion only; under keep_prompt a readmitted sample may hold the prompt
    pages of a sibling that has been compacted. Compressed samples are admitted only when
    the pool holds every cache at its bound, so in the same pool they share prompts and
    are never preempted."""
    ps = prompts(3, lo=12, hi=20, seed=5)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=2, ignore_eos=True)
    engine = small_engine(qwen2, 26, compress=COMPRESS[mode], max_prefill_tokens=24)
    outs = engine.generate(ps, params)
    stats = engine.last_stats
    assert (stats.preemptions > 0) == (mode == "dense") and stats.shared_prompt_tokens > 0
    assert engine.allocator.num_free == 26 and not any(engine.allocator.refs)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in outs)
    if mode == "dense":
        _same(outs, _generate(qwen2, None, False, ps, params)[1])
