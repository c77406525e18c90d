"""Eviction: pick the tokens each (sequence, layer, KV head) keeps with one batched
policy.select_batch call, then pack them into the first cache entries of the sequence.

Entry j of head h becomes the j-th kept token of head h, so after compaction every head of
every layer holds exactly `budget` entries and attention needs only the per-sequence
length. Kept indices are ascending and index[j] >= j, and all kept values are gathered
before any is written, so packing in place is safe. The caller returns the pages past
the first ceil(budget / page_size) to the pool (Scheduler.compacted).
"""
from __future__ import annotations

import torch

from minisparse.engine.kv_pool import KVPool

_GATHER_BYTES = 1 << 30  # cap on the gathered keys per group of sequences


@torch.no_grad()
def compact(pool: KVPool, policy, rows: list[int], cache_lens: list[int],
            next_pos: list[int]) -> None:
    """Compress the caches of the sequences in `rows` (runner slots) down to policy.budget.
    cache_lens: their entries now (each > budget); next_pos: their next RoPE position
    (used to read the query ring in time order)."""
    k = pool.k
    per_seq = k.shape[0] * k.shape[2] * max(cache_lens) * k.shape[3] * k.element_size()
    group = max(1, _GATHER_BYTES // per_seq)
    for i in range(0, len(rows), group):
        _compact_group(pool, policy, *(pool_tensor(pool, x[i:i + group])
                                       for x in (rows, cache_lens, next_pos)))


def pool_tensor(pool: KVPool, values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(pool.device)


def _compact_group(pool: KVPool, policy, rows: torch.Tensor, lens: torch.Tensor,
                   next_pos: torch.Tensor) -> None:
    n_layers, _, h_kv, d = pool.k.shape
    s, budget = rows.shape[0], policy.budget
    lmax = int(lens.max())
    slots = pool.slots(rows, lmax)  # [s, lmax]
    keys = pool.k[:, slots]  # [layers, s, lmax, H_kv, D]
    keys = keys.permute(1, 0, 3, 2, 4).reshape(s * n_layers, h_kv, lmax, d)
    queries = pool.ring_queries(rows, next_pos)  # [layers, s, W, H_q, D]
    queries = queries.permute(1, 0, 3, 2, 4).reshape(s * n_layers, -1, pool.window, d)
    keep = policy.select_batch(keys, queries, lens.repeat_interleave(n_layers))
    keep = keep.view(s, n_layers, h_kv, budget)
    src = slots[:, None, None, :].expand(s, n_layers, h_kv, lmax).gather(-1, keep)
    dst = slots[:, None, None, :budget]
    layer = torch.arange(n_layers, device=pool.device)[None, :, None, None]
    head = torch.arange(h_kv, device=pool.device)[None, None, :, None]
    for cache in (pool.k, pool.v):
        cache[layer, dst, head] = cache[layer, src, head]
