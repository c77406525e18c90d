"""Compressed rollouts of a real model keep what the float64 reference of their rule
would: Qwen2.5-Coder-0.5B-Instruct (see real_qwen) in float32 on a CPU, greedy on
MATH500 prompts, through the native engine with R-KV and SnapKV.

The rule tests (tests/compression) check the fast batched scoring against
tests/compression/reference.py on random keys; real keys have what random ones lack
(attention sinks, massive activations, RoPE's rotating pairs, heads whose keys all point
one way). Here every compaction of the rollout is intercepted: each (sequence, layer)'s
keys and recent queries are read naively from the pool before it, the packed cache after
it, and each packed entry is traced back to the position it came from. Per (sequence,
layer, head), those kept positions must be a correct choice by the reference's float64
scores (reference.check_selection: nothing dropped outscores anything kept by more than
ATOL, which leaves ties on max-pooling plateaus to either side).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
import torch

from compression import reference
from engine_helpers import read_cache
from minisparse.config.schema import CompressConfig
from real_qwen import engine, load_qwen, math_prompts, needs_math500, needs_model

pytestmark = [needs_model, needs_math500]
# Budget below every prompt, so each one is compressed at its prefill, then twice more
# while decoding (every DIVIDE tokens) in NEW tokens.
PROMPTS, NEW, BUDGET, WINDOW, DIVIDE = 4, 48, 32, 8, 16
# float32 scores against float64 ones, as tests/compression/test_select.py allows.
ATOL = 1e-6


@pytest.fixture(scope="module")
def qwen():
    return load_qwen()


@dataclass
class Compaction:
    """One (sequence, layer) of a compaction: the sequence's engine row, its keys
    [H_kv, L, D] and last W queries [H_q, W, D] before, and the positions [H_kv, budget]
    each head kept."""
    row: int
    layer: int
    keys: torch.Tensor
    queries: torch.Tensor
    kept: torch.Tensor


def traced(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Position in `before` [H_kv, L, 2D] (keys and values side by side) of each entry of
    `after` [H_kv, budget, 2D]: [H_kv, budget]. Every packed entry must equal exactly one
    entry of the cache it was packed from (RoPE makes every position's key distinct)."""
    same = (after[:, :, None] == before[:, None]).all(dim=-1)  # [H_kv, budget, L]
    assert (same.sum(dim=-1) == 1).all(), "a packed entry matches no cached one, or several"
    return same.int().argmax(dim=-1)


def capture(monkeypatch) -> list[Compaction]:
    """Wrap the engine's compaction to record each (sequence, layer)'s keys, queries and
    kept positions; returns the list it fills."""
    import minisparse.engine.engine as engine_mod

    real, seen = engine_mod.compact, []

    def compact(pool, policy, rows, lens, next_pos, protected=None):
        assert protected is None  # keep_prompt off
        before = {}
        for row, n, pos in zip(rows, lens, next_pos):
            q = pool.ring_queries(torch.tensor([row]), torch.tensor([pos]))[0]
            for layer in range(pool.k.shape[0]):
                k, v = read_cache(pool, layer, row, n)
                before[row, layer] = k.clone(), v.clone(), q[layer].clone()
        real(pool, policy, rows, lens, next_pos, protected)
        for (row, layer), (k, v, q) in before.items():
            after = torch.cat(read_cache(pool, layer, row, policy.budget), dim=-1)
            kept = traced(torch.cat([k, v], dim=-1), after)
            seen.append(Compaction(row, layer, k, q, kept))

    monkeypatch.setattr(engine_mod, "compact", compact)
    return seen


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_compressed_rollout_keeps_reference_choices_on_real_keys(qwen, monkeypatch,
                                                                  algorithm):
    from minisparse.engine import SamplingParams

    model, tok = qwen
    cfg = CompressConfig(algorithm=algorithm, budget=BUDGET, window=WINDOW,
                         divide_length=DIVIDE)
    prompts = math_prompts(tok, PROMPTS)
    assert min(map(len, prompts)) > BUDGET
    sampler = engine(model, tok, PROMPTS, cfg)
    seen = capture(monkeypatch)
    start = time.monotonic()
    outs = sampler.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW,
                                                    ignore_eos=True))
    engine_s = time.monotonic() - start
    assert all(o.num_compressions == 3 for o in outs), [o.num_compressions for o in outs]
    # Each prompt whole after its prefill, then budget + divide_length twice, every layer.
    lengths = [len(p) for p in prompts] + [BUDGET + DIVIDE] * 2 * PROMPTS
    assert len(seen) == len(lengths) * model.config.num_hidden_layers
    assert sorted(c.keys.shape[1] for c in seen if c.layer == 0) == sorted(lengths)
    worst = []  # (gap, row, layer, head, cache length)
    for c in seen:
        length = c.keys.shape[1]
        ref = reference.scores(c.keys, c.queries, algorithm, kernel_size=cfg.kernel_size,
                               pooling=cfg.pooling, group_pooling=cfg.group_pooling,
                               mix_lambda=cfg.mix_lambda, sim_threshold=cfg.sim_threshold)
        for h in range(c.kept.shape[0]):
            gap = reference.check_selection(c.kept[h:h + 1], ref[h:h + 1], length, BUDGET,
                                            WINDOW, "per_head", atol=float("inf"))
            worst.append((gap, c.row, c.layer, h, length))
    gap, row, layer, head, length = max(worst)
    print(json.dumps({"algorithm": algorithm, "prompt_tokens": list(map(len, prompts)),
                      "heads_checked": len(worst), "worst_gap": gap,
                      "engine_s": round(engine_s, 1),
                      "reference_s": round(time.monotonic() - start - engine_s, 1)}))
    assert gap <= ATOL, (f"{algorithm}: engine row {row}, layer {layer}, head {head} "
                         f"(cache of {length}): a dropped token outscores a kept one "
                         f"by {gap:.3g} in the float64 reference")
