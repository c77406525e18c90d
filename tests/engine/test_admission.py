"""Admission while sequences decode: with more samples than slots, answers that end one
by one free slots one by one; the engine stops the decode for a prefill step once a batch
of them is free (Scheduler.admission_due), not at each."""
from __future__ import annotations

import pytest

import minisparse.engine.scheduler as scheduler_mod
from engine_helpers import make_engine, prompts
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams

RKV = CompressConfig(algorithm="rkv", budget=24, window=4, divide_length=8)


def _run(model, monkeypatch, share: int, compress):
    monkeypatch.setattr(scheduler_mod, "ADMIT_SHARE", share)
    engine = make_engine(model, compress, page_size=4, max_num_seqs=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=80, seed=5, stop_token_ids=[5, 9])
    outs = engine.generate(prompts(48, lo=5, hi=30, seed=2), params)
    stats = engine.last_stats
    return [o.token_ids for o in outs], stats.prefill_steps, stats


@pytest.mark.parametrize("compress", [None, RKV], ids=["dense", "rkv"])
def test_a_batch_of_free_slots_admits_the_queue_in_fewer_prefill_steps(qwen2, monkeypatch,
                                                                       compress):
    every, every_steps, every_stats = _run(qwen2, monkeypatch, 10**6, compress)  # 1 slot
    batched, batched_steps, batched_stats = _run(qwen2, monkeypatch, 4, compress)  # 4
    lengths = sorted(len(t) for t in every)
    assert lengths[0] < 40 < lengths[-1]  # answers end one by one
    if compress is None:  # R-KV's trigger counts the batch's steps: a later start
        assert batched == every  # compacts at other lengths, so its samples differ
    assert batched_steps <= every_steps // 2, (batched_steps, every_steps)
    assert batched_stats.prefill_tokens <= every_stats.prefill_tokens
