"""Overlapped decode (EngineConfig.overlap_decode): step N + 1 is launched from step N's
tokens on the device before the host reads them. The samples must be the ones the
step-by-step engine draws, whatever stops, waits, compresses or gets preempted."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import make_engine, prompts
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams
from minisparse.engine.sequence import Sequence
from test_preemption import PAGE_BYTES

RKV = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel_size=3)
NEWLINE = dataclasses.replace(RKV, divide_method="newline")


def _run(model, overlap: bool, compress=None, seed: int = 11, **kw):
    newline = compress is NEWLINE  # the test tokenizer has no text: pick "newline" ids
    engine = make_engine(model, RKV if newline else compress, page_size=4,
                         overlap_decode=overlap, **kw)
    if newline:
        engine.compress, engine.newline_ids = NEWLINE, set(range(20, 60))
    launched, rows, runs = [], [], []
    runner = engine.runner
    real, real_launch, real_first = runner.next_inputs, runner.launch, runner.step_inputs
    runner.next_inputs = lambda *a: launched.append(1) or real(*a)
    runner.launch = lambda seqs, *a: rows.append(len(seqs)) or real_launch(seqs, *a)
    runner.step_inputs = lambda seqs: runs.append(1) or real_first(seqs)  # a run's first step
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, seed=seed,
                            stop_token_ids=[5, 9])
    outs = engine.generate(prompts(7, lo=4, hi=24, seed=3), params)
    engine.decode_runs = len(runs)
    return outs, engine, len(launched), sum(rows)


@pytest.mark.parametrize("case", ["dense", "rkv", "queue", "preempt", "newline", "max_len"])
def test_overlapped_decode_draws_the_same_samples(qwen2, case, monkeypatch):
    discounted = []  # sequences compacted ahead of the step at which they stopped
    real_discount = Sequence.discount_compaction
    monkeypatch.setattr(Sequence, "discount_compaction",
                        lambda seq, n: discounted.append(n) or real_discount(seq, n))
    # rkv: a seed at which two sequences stop at a step after which they fell due
    kw = {"dense": {}, "rkv": {"compress": RKV, "seed": 14}, "queue": {"max_num_seqs": 3},
          "preempt": {"kv_memory_gb": 21 * PAGE_BYTES / 2**30, "max_prefill_tokens": 8},
          "newline": {"compress": NEWLINE}, "max_len": {"max_model_len": 40}}[case]
    want, ref, none, ref_rows = _run(qwen2, False, **kw)
    got, engine, overlapped, rows = _run(qwen2, True, **kw)
    assert none == 0 and ref_rows == ref.last_stats.decode_tokens
    # a sequence that stops on a sampled token costs at most one extra row; one that
    # reaches its length is never launched again
    stops = sum(o.finish_reason == "stop" for o in want)
    if case != "preempt":  # recomputed sequences decode a different number of rows
        assert ref_rows <= rows <= ref_rows + stops
    if case == "newline":  # the trigger reads each sampled token: never overlapped
        assert overlapped == 0
    else:
        assert overlapped > 0
    if case == "rkv":  # every prompt admitted at once: compaction never ends a run of steps
        assert ref.last_stats.compress_events > 1 and engine.decode_runs == 1 < ref.decode_runs
        assert len(discounted) == 2 and min(discounted) > 0
    reasons = {o.finish_reason for o in want}
    assert "stop" in reasons and "length" in reasons  # both ways of finishing happen
    for a, b in zip(got, want):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert (a.num_compressions, a.evicted_tokens, a.peak_cache_tokens) == (
            b.num_compressions, b.evicted_tokens, b.peak_cache_tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    s, r = engine.last_stats, ref.last_stats
    if case == "preempt":
        # a sequence admitted one step later (its room appeared while the next step was
        # already launched) changes which ones get preempted, and so the recomputation,
        # but not the samples
        assert r.preemptions > 0 and s.preemptions > 0
    else:
        assert (s.decode_tokens, s.decode_kv_tokens, s.compressions, s.preemptions) == (
            r.decode_tokens, r.decode_kv_tokens, r.compressions, r.preemptions)
    if case in ("rkv", "newline"):
        assert r.compressions > 0
    assert engine.allocator.num_free == engine.pool.num_pages  # no page leaked
