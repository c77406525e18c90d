"""The real-model ablation configs (coder1.5b_dense, _rkv, _snapkv): the variants differ
in the sampler's cache alone, and every one is scored on all of MATH500 with a dense cache,
so their held-out figures compare (docs/results.md)."""
from __future__ import annotations

import dataclasses

import pytest

from minisparse.config.load import dotted_items, load_config


def _settings(name: str, overrides: tuple[str, ...] = ()) -> dict:
    return dotted_items(dataclasses.asdict(load_config(name, list(overrides))))


@pytest.mark.parametrize("name, base, algorithm", [
    ("coder1.5b_rkv", "coder1.5b_dense", "rkv"),
    ("coder1.5b_snapkv", "coder1.5b_rkv", "snapkv"),
])
def test_a_variant_changes_the_cache_alone(name, base, algorithm):
    mine, theirs = _settings(name), _settings(base)
    differ = {k for k in mine if mine[k] != theirs[k]} - {"output_dir"}
    assert differ <= {k for k in mine if k.startswith("compress.")}
    assert mine["compress.algorithm"] == algorithm


def test_snapkv_keeps_r_kvs_budget_window_and_trigger():
    """192 of the 1,536-token limit kept (an eighth, as the paper's 512 of 4,096), the last
    8 queries observed, compressed every 32 tokens: as rkv."""
    c = load_config("coder1.5b_snapkv")
    assert (c.compress.budget, c.compress.window, c.compress.divide_length) == (192, 8, 32)
    assert c.compress.budget * 8 == c.max_response_len and not c.compress.keep_prompt


@pytest.mark.parametrize("name", ["coder1.5b_dense", "coder1.5b_rkv", "coder1.5b_snapkv"])
def test_every_variant_is_scored_alike_on_all_of_math500(name):
    """At the paper's length (--rollouts 100 --eval-every 20) as at 30 rollouts: before
    training and every eval_interval, all 500 problems, 2 samples each, the training
    rows' chat turn, a dense cache."""
    cfg = load_config(name, ["num_rollout=100", "eval_interval=20", "save_interval=20"])
    e = cfg.eval
    assert (e.benchmarks, e.limit, e.n_samples, e.prompt_template) == (["math500"], None, 2,
                                                                       "chat")
    assert not e.compress and cfg.eval_before_training
    assert (e.temperature, e.top_p, e.max_new_tokens) == (0.8, 0.95, 4096)
    assert (cfg.num_rollout, cfg.eval_interval, cfg.save_interval) == (100, 20, 20)
