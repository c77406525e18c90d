"""Sampling: seeded reproducibility independent of batch composition, top-k=1 == greedy,
log-probs of the distribution sampled (renormalised over the top-k / top-p set), and the
sampler's distribution."""
from __future__ import annotations

import torch

from engine_helpers import dense_logprobs, make_engine, prompts
from minisparse.engine import SamplingParams
from minisparse.engine.layers.sampler import sample, truncate, unit_interval


def test_seeded_runs_reproduce_and_ignore_batch_composition(qwen2):
    engine = make_engine(qwen2)
    ps = prompts(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=11, ignore_eos=True)
    a, b = engine.generate(ps, params), engine.generate(ps, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    alone = engine.generate(ps[:1], params)
    assert [o.token_ids for o in alone] == [o.token_ids for o in a[:2]]
    other = engine.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=12,
                                               ignore_eos=True))
    assert [o.token_ids for o in other] != [o.token_ids for o in a]


def test_seed_offset_samples_a_split_batch_like_the_whole(qwen2):
    """Prompts 2..3 alone, offset by the 2 x n samples before them, sample what they
    sample in the whole call (how evaluation splits a benchmark over ranks)."""
    engine = make_engine(qwen2)
    ps = prompts(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=11, ignore_eos=True)
    whole = engine.generate(ps, params)
    tail = engine.generate(ps[2:], SamplingParams(temperature=1.0, max_new_tokens=12, n=2,
                                                  seed=11, ignore_eos=True, seed_offset=4))
    assert [o.token_ids for o in tail] == [o.token_ids for o in whole[4:]]
    assert [o.token_ids for o in engine.generate(ps[2:], params)] != [o.token_ids for o in tail]


def test_top_k_one_is_greedy_with_the_truncated_laws_log_prob_zero(model):
    engine = make_engine(model)
    ps = prompts(3)
    greedy = engine.generate(ps, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    top1 = engine.generate(ps, SamplingParams(temperature=0.7, top_k=1, max_new_tokens=16, seed=0,
                                              ignore_eos=True))
    for p, g, t in zip(ps, greedy, top1):
        assert g.token_ids == t.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), dense_logprobs(model, p, g.token_ids),
                                   atol=1e-4, rtol=0)
        # one token kept: the sampler drew it with probability 1
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.zeros(16), atol=1e-6, rtol=0)


def test_top_p_top_k_tokens_stay_in_the_nucleus(qwen2):
    engine = make_engine(qwen2)
    ps = prompts(3)
    T, k, p_top = 1.3, 20, 0.6
    outs = engine.generate(ps, SamplingParams(temperature=T, top_k=k, top_p=p_top, n=2, seed=5,
                                              max_new_tokens=16, ignore_eos=True))
    for o in outs:
        rows = dense_logprobs(qwen2, ps[o.prompt_index], o.token_ids, temperature=T, full=True)
        law = torch.log_softmax(truncate(rows, k, p_top), -1)  # renormalised over the nucleus
        lp = torch.tensor(o.logprobs)
        torch.testing.assert_close(lp, law.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        assert bool((lp > rows.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]).all())
        for row, tok in zip(rows, o.token_ids):
            probs, order = row.exp().sort(descending=True)
            rank = (order == tok).nonzero().item()
            assert rank < k and probs[:rank].sum() <= p_top + 1e-5


def test_sampler_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(40000, 1)
    seeds = torch.arange(40000, dtype=torch.long)
    steps = torch.zeros(40000, dtype=torch.long)
    for T, top_p in ((1.0, 1.0), (0.5, 1.0), (1.0, 0.7)):
        tokens, lps = sample(logits, T, -1, top_p, seeds, steps)
        probs = torch.softmax(logits[0] / T, -1)
        if top_p < 1:  # nucleus of the sorted probs, renormalised
            keep = (probs.cumsum(-1) - probs) < top_p
            probs = torch.where(keep, probs, 0) / probs[keep].sum()
        torch.testing.assert_close(lps, probs.log()[tokens])  # the law it sampled from
        freq = torch.bincount(tokens, minlength=6).float() / 40000
        torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    again, _ = sample(logits, 1.0, -1, 1.0, seeds, steps + 1)
    assert (again != sample(logits, 1.0, -1, 1.0, seeds, steps)[0]).float().mean() > 0.3


def test_noise_stays_strictly_inside_unit_interval():
    """The extreme hashes must not map to 0 or 1: u == 1 gives +inf Gumbel noise, which
    would win every argmax (and turn truncated -inf logits into NaN)."""
    bits = torch.tensor([0, 1, (1 << 31), 0xFFFFFFFE, 0xFFFFFFFF], dtype=torch.int64)
    u = unit_interval(bits)
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    gumbel = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(gumbel).all())


def test_top_k_one_never_picks_a_truncated_token_at_large_vocab():
    """At a 150k vocabulary some column gets the largest hash within a few hundred steps;
    top-k=1 must still return the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(64, 151936)
    seeds = torch.arange(64, dtype=torch.int64) * 7919
    for step in range(8):
        steps = torch.full((64,), step, dtype=torch.int64)
        tokens, _ = sample(logits, 0.8, 1, 1.0, seeds, steps)
        assert torch.equal(tokens, logits.argmax(-1))
