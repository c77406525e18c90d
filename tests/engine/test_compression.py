"""Compressed generation: every decode step's attention equals a naive reference over the
tokens the policy kept (engine_helpers.Tracker), caches stay within their bound, and pages
come back to the pool."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import make_engine, prompts, read_cache, track
from minisparse.compression import compress_due, max_cache_tokens
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams

CFG = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel_size=3)


@pytest.fixture
def tracked(monkeypatch, qwen2):
    engine = make_engine(qwen2, CFG, page_size=4)
    return engine, track(engine, monkeypatch)


def test_decode_attention_equals_reference_over_kept_tokens(tracked):
    engine, tr = tracked
    ps = prompts(4, lo=5, hi=30)
    outs = engine.generate(ps, SamplingParams(temperature=0.9, max_new_tokens=40, seed=3,
                                              ignore_eos=True))
    stats = engine.last_stats
    assert stats.compressions > 0 and tr.checked > 0
    assert tr.max_err < 1e-5
    heads = [e for e in tr.entries.values()]
    assert any(h[0] != h[1] for h in heads), "per-head selection should differ across heads"
    bound = max_cache_tokens(CFG)
    for p, o in zip(ps, outs):
        assert len(o.token_ids) == 40 and o.finish_reason == "length"
        assert o.peak_cache_tokens <= max(bound, len(p))
        assert (o.num_compressions, o.evicted_tokens) == simulate(len(p), 40)
    assert stats.evicted_tokens == sum(o.evicted_tokens for o in outs)
    assert engine.allocator.num_free == engine.pool.num_pages


def test_compressed_cache_stays_bounded_without_page_leaks(qwen2):
    engine = make_engine(qwen2, CFG, page_size=4)
    pages_seen = []
    real = engine.runner.launch

    def launch(seqs, sp, inputs):
        pages_seen.append(engine.allocator.num_used)
        assert all(s.cache_len < max_cache_tokens(CFG) for s in seqs)
        return real(seqs, sp, inputs)
    engine.runner.launch = launch
    n, steps = 3, 1000
    outs = engine.generate(prompts(n, lo=5, hi=20), SamplingParams(max_new_tokens=steps,
                                                                  ignore_eos=True, seed=0))
    per_seq = engine.allocator.pages_for(max_cache_tokens(CFG))
    assert max(pages_seen) <= n * per_seq
    assert engine.allocator.num_free == engine.pool.num_pages
    for o in outs:
        assert len(o.token_ids) == steps
        assert (o.num_compressions, o.evicted_tokens) == simulate(len(o.prompt_token_ids), steps)


def trigger_steps(prompt_len: int, new_tokens: int, cfg: CompressConfig = CFG):
    """(decode step, cache length before) of each compression the trigger implies for a
    sequence decoded from the call's first step: a check after prefill (step 0), then one
    after each decode step but the last (which finishes the sequence). Under keep_prompt
    the trigger counts the cache past the prompt, which stays."""
    cache = prompt_len
    prompt = prompt_len if cfg.keep_prompt else 0
    for step in range(new_tokens - 1):
        cache += step > 0
        if bool(compress_due(torch.tensor([cache - prompt]), step, torch.tensor([False]), cfg)):
            yield step, cache
            cache = prompt + cfg.budget


def simulate(prompt_len: int, new_tokens: int, cfg: CompressConfig = CFG) -> tuple[int, int]:
    """(compressions, evicted tokens) the trigger implies."""
    kept = (prompt_len if cfg.keep_prompt else 0) + cfg.budget
    events = list(trigger_steps(prompt_len, new_tokens, cfg))
    return len(events), sum(cache - kept for _, cache in events)


def first_compression_step(prompt_len: int, new_tokens: int, cfg: CompressConfig = CFG) -> int:
    """The decode step after which the trigger first fires (new_tokens - 1 when never)."""
    return next((step for step, _ in trigger_steps(prompt_len, new_tokens, cfg)),
                new_tokens - 1)


@pytest.mark.parametrize("keep_prompt", [False, True])
def test_compressed_tokens_count_those_sampled_after_the_first_eviction(qwen2, keep_prompt):
    """compress/compressed_token_frac's numerator: every token sampled after the step whose
    compression first evicted something, none before; a dense engine counts none."""
    cfg = dataclasses.replace(CFG, keep_prompt=keep_prompt)
    engine = make_engine(qwen2, cfg, page_size=4)
    ps = prompts(4, lo=5, hi=30, seed=4)
    outs = engine.generate(ps, SamplingParams(temperature=0.9, max_new_tokens=40, seed=1,
                                              ignore_eos=True))
    for p, o in zip(ps, outs):
        assert o.compressed_tokens == 40 - 1 - first_compression_step(len(p), 40, cfg)
        assert 0 < o.compressed_tokens < 40
    dense = make_engine(qwen2, None, page_size=4)
    outs = dense.generate(ps, SamplingParams(temperature=0.9, max_new_tokens=40, seed=1,
                                             ignore_eos=True))
    assert all(o.compressed_tokens == 0 for o in outs)


def test_keep_prompt_never_evicts_the_prompt(monkeypatch, qwen2):
    """keep_prompt with prompts longer than the budget: no compression at prefill, every
    layer and head still attends to the whole prompt after each compaction (attention
    checked against the kept tokens), then budget response tokens; a cache holds at most
    prompt + budget + divide_length entries, and every page comes back."""
    cfg = dataclasses.replace(CFG, keep_prompt=True)
    engine = make_engine(qwen2, cfg, page_size=4)
    tr = track(engine, monkeypatch)
    ps = prompts(4, lo=18, hi=30, seed=2)
    outs = engine.generate(ps, SamplingParams(temperature=0.9, max_new_tokens=50, seed=5,
                                              ignore_eos=True))
    assert tr.checked > 0 and tr.max_err < 1e-5
    by_seq = {}
    for (seq_id, layer), heads in tr.entries.items():
        by_seq.setdefault(seq_id, []).extend(heads)
    for i, (p, o) in enumerate(zip(ps, outs)):
        assert (o.num_compressions, o.evicted_tokens) == simulate(len(p), 50, cfg)
        assert o.num_compressions >= 2
        assert o.peak_cache_tokens <= max_cache_tokens(cfg, len(p))
        for head in by_seq[i]:
            assert head[:len(p)] == list(range(len(p)))
            assert len(head) <= len(p) + cfg.budget + cfg.divide_length
    assert engine.allocator.num_free == engine.pool.num_pages


def test_long_prompt_compresses_right_after_prefill(qwen2):
    engine = make_engine(qwen2, CFG, page_size=4)
    p = prompts(1, lo=60, hi=60)[0]
    out = engine.generate([p], SamplingParams(temperature=0, max_new_tokens=3))[0]
    assert out.peak_cache_tokens == 60
    assert out.num_compressions == 1 and out.evicted_tokens == 60 - CFG.budget


def test_newline_trigger_fires_on_generated_newlines():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine_helpers import SHAPE
    from minisparse.compression import newline_token_ids
    from minisparse.config.schema import EngineConfig
    from minisparse.engine import LLMEngine
    from minisparse.models.tiny import build_tokenizer

    tok = build_tokenizer(vocab_size=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**(SHAPE | dict(vocab_size=len(tok))))).eval()
    cfg = CompressConfig(algorithm="snapkv", budget=16, window=4, divide_method="newline",
                         divide_length=4, kernel_size=3)  # hard cap: budget + 16
    engine = LLMEngine(model, tok, EngineConfig(page_size=4, kv_cpu_memory_gb=0.02,
                                                max_num_seqs=8), cfg)
    assert engine.newline_ids == set(newline_token_ids(tok))
    newline = engine.newline_ids = set(range(0, len(tok), 8))  # frequent "newlines"
    params = SamplingParams(temperature=1.5, max_new_tokens=80, seed=4, ignore_eos=True)
    ps, by_newline = prompts(4, lo=5, hi=15), 0
    for p, o in zip(ps, engine.generate(ps, params)):
        cache, count = len(p), 0
        for i, tok_id in enumerate(o.token_ids[:-1]):
            cache += i > 0
            due = compress_due(torch.tensor([cache]), i, torch.tensor([tok_id in newline]), cfg)
            if bool(due):
                by_newline += cache < cfg.budget + 16
                count, cache = count + 1, cfg.budget
        assert o.num_compressions == count
        assert o.peak_cache_tokens <= max(len(p), max_cache_tokens(cfg))
    assert by_newline > 0


KNORM = CompressConfig(algorithm="knorm", budget=16, window=4, divide_length=8)
KEEP_PROMPT = dataclasses.replace(CFG, keep_prompt=True)


@pytest.mark.parametrize("cfg", [CFG, KNORM, KEEP_PROMPT], ids=["rkv", "knorm", "keep_prompt"])
def test_compaction_keeps_what_select_picks_from_each_rows_own_keys(qwen2, monkeypatch, cfg):
    """The batched compaction (gather, select_batch, pack) leaves in each (sequence, layer,
    head) exactly the K/V that policy.select picks from that row's own keys and queries,
    read naively from the pool: catches rows of the batch scored against another row's
    (or another layer's) keys, which attention-over-kept-tokens checks cannot see. Under
    keep_prompt the prompt's entries come first, unmoved, then budget selected ones."""
    import minisparse.engine.engine as engine_mod

    engine = make_engine(qwen2, cfg, page_size=4)
    assert (engine.pool.q_ring is None) == (cfg is KNORM)  # knorm scores without queries
    real, sizes = engine_mod.compact, []

    def compact(pool, policy, rows, lens, next_pos, protected=None):
        assert (protected is not None) == cfg.keep_prompt
        protected = protected or [0] * len(rows)
        want = {}
        for row, n, pos, first in zip(rows, lens, next_pos, protected):
            q = None
            if policy.uses_queries:
                q = pool.ring_queries(torch.tensor([row]), torch.tensor([pos]))[0]
            for layer in range(pool.k.shape[0]):
                keys, values = read_cache(pool, layer, row, n)
                keep = policy.select(keys, None if q is None else q[layer],
                                     first)
                assert keep.shape[1] == first + policy.budget
                keep = keep[..., None]
                want[row, layer, first] = (keys.gather(1, keep.expand(-1, -1, keys.shape[-1])),
                                           values.gather(1, keep.expand(-1, -1, keys.shape[-1])))
        real(pool, policy, rows, lens, next_pos, None if not cfg.keep_prompt else protected)
        for (row, layer, first), (k, v) in want.items():
            got_k, got_v = read_cache(pool, layer, row, first + policy.budget)
            assert torch.equal(got_k, k) and torch.equal(got_v, v), (row, layer)
        sizes.append(len(rows))

    monkeypatch.setattr(engine_mod, "compact", compact)
    ps = prompts(5, lo=12, hi=12, seed=4)  # same length: compressed together
    outs = engine.generate(ps, SamplingParams(max_new_tokens=40, seed=1, ignore_eos=True))
    assert max(sizes) == 5
    assert all(o.num_compressions > 0 for o in outs)


def test_streaming_llm_keeps_sinks_and_the_newest_tokens_without_a_query_ring(qwen2,
                                                                              monkeypatch):
    """A rule that scores without queries: the engine keeps no query ring for it, decode
    attends to exactly the sinks and the newest tokens, in every layer and head."""
    cfg = CompressConfig(algorithm="streaming_llm", budget=16, window=4, divide_length=8,
                         n_sink=3)
    engine = make_engine(qwen2, cfg, page_size=4)
    assert engine.pool.window == 0 and engine.pool.q_ring is None
    tr = track(engine, monkeypatch)
    engine.generate(prompts(3, lo=5, hi=30), SamplingParams(max_new_tokens=40, seed=2,
                                                             ignore_eos=True))
    assert engine.last_stats.compressions > 0 and tr.checked > 0 and tr.max_err < 1e-5
    heads = [h for layers in tr.entries.values() for h in layers]
    for head in heads:
        assert head[:3] == [0, 1, 2] and head[3:] == list(range(head[3], head[-1] + 1))
    assert all(len(h) <= max_cache_tokens(cfg) for h in heads)
    assert sum(h[3] > 3 for h in heads) == len(heads)  # every sequence evicted the middle
    assert engine.allocator.num_free == engine.pool.num_pages


@pytest.mark.parametrize("prompt_len, budget, divide_length", [
    (16, 16, 128),  # the prompt just fits: due at divide_length generated tokens
    (256, 16, 128),  # past budget + divide_length: compressed right after the prefill
    (10, 16, 8), (20, 16, 8), (30, 16, 8),
])
@pytest.mark.parametrize("keep_prompt", [False, True])
def test_first_compression_len_is_exact(qwen2, prompt_len, budget, divide_length, keep_prompt):
    """The shortest response that sees a compression: one token fewer sees none. What
    the bench and train.py check before a run that compression would never reach."""
    from minisparse.compression.trigger import first_compression_len

    cfg = CompressConfig(algorithm="rkv", budget=budget, window=4,
                         divide_length=divide_length, kernel_size=3, keep_prompt=keep_prompt)
    engine = make_engine(qwen2, cfg, page_size=4)
    need = first_compression_len(cfg, prompt_len)
    seen = []
    for new in (need - 1, need):
        out, = engine.generate([[5 + i % 100 for i in range(prompt_len)]], SamplingParams(
            temperature=1.0, max_new_tokens=new, seed=0, ignore_eos=True))
        seen.append(out.num_compressions)
    assert seen == [0, 1]


def test_dense_context_generates_as_a_dense_engine(qwen2):
    """engine.dense() (a compressed run's in-training evaluation): the same samples as a
    dense engine's, nothing evicted; compression is back after it."""
    engine, plain = make_engine(qwen2, CFG, page_size=4), make_engine(qwen2, None, page_size=4)
    ps = prompts(3, lo=5, hi=20, seed=7)
    params = SamplingParams(temperature=0.9, max_new_tokens=40, seed=3, ignore_eos=True)
    with engine.dense():
        outs = engine.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(ps, params)]
    assert all(o.num_compressions == 0 for o in outs)
    assert all(o.num_compressions > 0 for o in engine.generate(ps, params))


@pytest.mark.parametrize("cfg", [CFG, KEEP_PROMPT], ids=["rkv", "keep_prompt"])
def test_warm_up_touches_only_the_scratch_page(qwen2, cfg):
    """The start-up event that builds compaction's kernels runs on the scratch row: every
    real page keeps its K/V, and the scratch page is where it wrote."""
    from minisparse.engine.compaction import warm_up

    engine = make_engine(qwen2, cfg, page_size=4)
    pool = engine.pool
    torch.manual_seed(0)
    pool.k.normal_()
    pool.v.normal_()
    k, v = pool.k.clone(), pool.v.clone()
    warm_up(pool, engine.rule)
    real = pool.num_pages * pool.page_size  # slots past it: the scratch page
    assert torch.equal(pool.k[:, :real], k[:, :real])
    assert torch.equal(pool.v[:, :real], v[:, :real])
    assert not torch.equal(pool.k[:, real:], k[:, real:])
