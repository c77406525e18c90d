"""Slow float64 reference of the selection rule, written straight from its definition
(docs/compression.md) with explicit loops, to check the fast batched path against.

Also the score-based comparison the tests share: max pooling makes plateaus of equal
scores, and on a plateau that straddles the cut any of the tied tokens is a correct pick,
so selections are judged by the reference scores of what they kept, not by index.
"""
from __future__ import annotations

import math

import torch


def importance(keys: torch.Tensor, queries: torch.Tensor, kernel_size: int, pooling: str,
               group_pooling: str) -> torch.Tensor:
    """[H_kv, N] attention importance of the N = L - W older tokens."""
    h_kv, length, dim = keys.shape
    h_q, window, _ = queries.shape
    group = h_q // h_kv
    older = length - window
    out = torch.zeros(h_kv, older, dtype=torch.float64)
    for h in range(h_kv):
        heads = range(h * group, (h + 1) * group)
        mean_attn = torch.zeros(older, dtype=torch.float64)
        for w in range(window):
            per_head = torch.stack([keys[h, :older] @ queries[q, w] / math.sqrt(dim)
                                    for q in heads])
            logits = per_head.max(0).values if group_pooling == "max" else per_head.mean(0)
            weights = torch.exp(logits - logits.max())
            mean_attn += weights / weights.sum() / window
        out[h] = pool(mean_attn, kernel_size, pooling)
    return out


def pool(values: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Stride-1 pooling with kernel_size // 2 padding on each side; average pooling
    divides by kernel_size (padding counts as zeros)."""
    half = kernel_size // 2
    out = torch.empty_like(values)
    for i in range(len(values)):
        window = values[max(0, i - half): i + half + 1]
        out[i] = window.max() if pooling == "max" else window.sum() / kernel_size
    return out


def redundancy(keys: torch.Tensor, window: int, sim_threshold: float) -> torch.Tensor:
    """[H_kv, N] R-KV redundancy of the older tokens."""
    h_kv, length, _ = keys.shape
    out = torch.zeros(h_kv, length - window, dtype=torch.float64)
    for h in range(h_kv):
        unit = keys[h] / (keys[h].norm(dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.T
        sim.fill_diagonal_(0.0)
        rows = sim.tolist()
        for i in range(length):
            above = [j for j in range(length) if rows[i][j] > sim_threshold]
            sim[i, max(above) if above else 0] = 0.0
        col = sim.mean(dim=0)
        soft = torch.exp(col - col.max())
        out[h] = (soft / soft.sum())[: length - window]
    return out


def streaming_llm_kept(length: int, budget: int, window: int, n_sink: int) -> list[int]:
    """StreamingLLM's kept positions: the first n_sink (as many as budget - window
    allows), then the most recent tokens up to the budget, the last window among them."""
    sinks = list(range(min(n_sink, budget - window)))
    return sinks + list(range(length - (budget - len(sinks)), length))


def key_norm_scores(keys: torch.Tensor, window: int) -> torch.Tensor:
    """[H_kv, N] KNorm's scores: minus each older key's L2 norm."""
    h_kv, length, dim = keys.shape
    out = torch.zeros(h_kv, length - window, dtype=torch.float64)
    for h in range(h_kv):
        for i in range(length - window):
            out[h, i] = -math.sqrt(sum(float(x) ** 2 for x in keys[h, i]))
    return out


def scores(keys: torch.Tensor, queries: torch.Tensor | None, algorithm: str,
           kernel_size: int = 7, pooling: str = "max", group_pooling: str = "max",
           mix_lambda: float = 0.1, sim_threshold: float = 0.5, window: int | None = None,
           budget: int | None = None, n_sink: int = 4) -> torch.Tensor:
    """[H_kv, N] eviction scores (higher = keep) in float64. streaming_llm (which needs
    budget): 1 for the older tokens it keeps, 0 for the rest. The query-free rules take
    window from the argument, the others from queries unless given."""
    keys = keys.double().cpu()
    if algorithm == "knorm":
        return key_norm_scores(keys, window)
    if algorithm == "streaming_llm":
        h_kv, length, _ = keys.shape
        out = torch.zeros(h_kv, length - window, dtype=torch.float64)
        out[:, streaming_llm_kept(length, budget, window, n_sink)[:budget - window]] = 1.0
        return out
    queries = queries.double().cpu()
    window = queries.shape[1] if window is None else window
    imp = importance(keys, queries, kernel_size, pooling, group_pooling)
    if algorithm == "snapkv":
        return imp
    return mix_lambda * imp - (1 - mix_lambda) * redundancy(keys, window, sim_threshold)


def check_selection(kept: torch.Tensor, ref_scores: torch.Tensor, length: int, budget: int,
                    window: int, selection: str, atol: float) -> float:
    """Assert `kept` [H_kv, budget] is a correct selection for these reference scores.

    Each head must keep the last `window` tokens plus budget - window older ones whose
    reference scores are all >= every dropped token's score - atol ("per_layer": the
    scores summed over heads, same picks in every head). Returns the worst violation
    margin seen (0 when none), useful to report agreement in lower precisions.
    """
    kept = kept.cpu()
    h_kv = ref_scores.shape[0]
    assert kept.shape == (h_kv, budget), kept.shape
    if selection == "per_layer":
        assert (kept == kept[0]).all(), "per_layer picks differ between heads"
        ref_scores = ref_scores.sum(dim=0, keepdim=True).expand(h_kv, -1)
    worst = 0.0
    for h in range(h_kv):
        row = kept[h].tolist()
        assert row == sorted(set(row)), "indices must be unique and ascending"
        assert row[-window:] == list(range(length - window, length)), "window not kept"
        older = torch.tensor(row[:-window], dtype=torch.long)
        assert older.numel() == budget - window and int(older.max()) < length - window
        dropped = torch.ones(length - window, dtype=torch.bool)
        dropped[older] = False
        gap = float(ref_scores[h, dropped].max() - ref_scores[h, older].min())
        worst = max(worst, gap)
    assert worst <= atol, f"a dropped token outscores a kept one by {worst:.3g}"
    return worst


def assert_same_selection(kept: torch.Tensor, other: torch.Tensor, ref_scores: torch.Tensor,
                          selection: str, atol: float) -> None:
    """Assert two selections [H_kv, budget] are the same picks up to near-ties.

    Two computations of the same scores in float (other batch shapes, chunking, another
    CPU's kernels) round differently, so where two tokens' reference scores are within
    `atol` of each other at the budget boundary either may be kept. Every index that one
    selection keeps and the other drops must sit within atol of that boundary.
    """
    kept, other = kept.cpu(), other.cpu()
    assert kept.shape == other.shape, (kept.shape, other.shape)
    if selection == "per_layer":
        ref_scores = ref_scores.sum(dim=0, keepdim=True).expand(kept.shape[0], -1)
    for h in range(kept.shape[0]):
        a, b = set(kept[h].tolist()), set(other[h].tolist())
        if a == b:
            continue
        older = sorted(a & b)
        n = ref_scores.shape[1]
        common = [i for i in older if i < n]
        boundary = float(ref_scores[h, common].min()) if common else float("nan")
        for i in a ^ b:
            assert i < n, f"head {h}: index {i} differs inside the window"
            gap = abs(float(ref_scores[h, i]) - boundary)
            assert gap <= atol, f"head {h}: index {i} differs but is {gap:.3g} from the boundary"
