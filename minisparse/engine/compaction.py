"""Eviction: pick the tokens each (sequence, layer, KV head) keeps with one batched
rule.select_batch call, then pack them into the first cache entries of the sequence.

Entry j of head h becomes the j-th kept token of head h, so after compaction every head of
every layer holds exactly `budget` entries and attention needs only the per-sequence
length. Under keep_prompt a sequence's first P entries (its prompt) stay where they are
and entry P + j takes the j-th kept token after them: P + budget entries. Kept indices are
ascending and index[j] >= P + j, and all kept values are gathered before any is written,
so packing in place is safe. The caller returns the pages past the first
ceil((P + budget) / page_size) to the pool (Scheduler.compacted).

On CUDA the key gather and the packing are Triton kernels (triton_compaction) that read
the page table themselves; the PyTorch copies here are the CPU path and their reference.
For the shipped SnapKV and R-KV rules on CUDA one kernel (triton_scores) scores every
entry straight from the pool and the query ring, with no gathered copy: the rule's
score_batch is then the reference, and the path of every other rule.
"""
from __future__ import annotations

import torch

from minisparse.compression.rules.rkv import RKV
from minisparse.compression.rules.snapkv import SnapKV
from minisparse.engine.kv_pool import KVPool, word_rows
from minisparse.utils.kernels import triton_module
from minisparse.utils.transfer import to_device

_SCRATCH_BYTES = 1 << 30  # cap on the gathered keys (or scores) per group of sequences
# score_batch methods triton_scores computes, and whether with R-KV's redundancy
_FUSED = {SnapKV.score_batch: False, RKV.score_batch: True}
# the most sequences x entries^1.5 an event may hold for the kernel to serve R-KV's: its
# redundancy (an entries x entries similarity a head, searched per block of entries) grows
# faster with the cache than the rule's path (~40 launches, batched GEMMs). One event on
# an H200, the 1.5B, keys random / sharing a direction per head (as real keys do, so the
# search stops early), fused against the rule's path, ms: at 224 entries 1.65 / 1.92 and
# 1.24 / 1.60 (64 sequences), 3.22 / 2.74 and 2.40 / 2.43 (128); at 320 entries 2.68 /
# 2.44 and 1.93 / 2.46 (64); at 640 1.09 / 1.53 and 0.68 / 1.38 (8), 1.93 / 1.57 and
# 1.12 / 1.44 (16), 3.49 / 2.17 and 1.96 / 1.82 (32). The cap keeps the kernel where it
# wins on keys like real ones; random keys it costs up to 23% where measured (640 x 16),
# likely more at 17-24 sequences of 640 entries (61% at 32, above the cap).
_FUSED_MAX_WORK = {RKV.score_batch: 400_000}


@torch.no_grad()
def compact(pool: KVPool, rule, rows: list[int], cache_lens: list[int],
            next_pos: list[int], protected: list[int] | None = None,
            fused: bool = True) -> None:
    """Compress the caches of the sequences in `rows` (runner slots) down to rule.budget
    entries after their first protected[i] (None: 0 each), which stay. cache_lens: their
    entries now (each > protected + budget); next_pos: their next RoPE position (used to
    read the query ring in time order). fused False: score with the rule's score_batch
    even where the fused scoring kernel serves the rule (to measure one against the
    other)."""
    k = pool.k
    scorer = fused_scorer(pool, rule, len(rows), max(cache_lens)) if fused else None
    # per sequence: its gathered keys, or with the fused kernel (which gathers nothing)
    # its float32 scores, their scratch and the selection's masked copy
    width = 16 if scorer else k.shape[3] * k.element_size()
    group = max(1, _SCRATCH_BYTES // (k.shape[0] * k.shape[2] * max(cache_lens) * width))
    protected = [0] * len(rows) if protected is None else protected
    for i in range(0, len(rows), group):
        # one copy, queued without a host wait (a plain .to(device) waits for the GPU)
        values = [x[i:i + group] for x in (rows, cache_lens, next_pos, protected)]
        _compact_group(pool, rule, *to_device(values, pool.device),
                       lmax=max(cache_lens[i:i + group]), scorer=scorer)


def warm_up(pool: KVPool, rule) -> None:
    """Run one event through each scoring path (the fused kernel where it serves the
    rule, and the rule's own) on the pool's scratch row, whose every entry maps to the
    scratch page: Triton builds every compaction kernel now, not in a rollout. Why: an
    event of a few sequences takes the fused path, which the first rollout's large events
    never reach, so its build (2-3 s on an H200) landed in whichever later rollout first
    held a small event. Nothing but the scratch page is read or written."""
    entries = rule.budget + 1  # the shortest cache an event compacts
    if entries > pool.pages_per_seq * pool.page_size:
        return
    row = pool.scratch_row
    paths = [False] + ([True] if fused_scorer(pool, rule, 1, entries) else [])
    for fused in paths:  # the rule's own, then the fused kernel where it serves the rule
        compact(pool, rule, [row], [entries], [entries], fused=fused)


def fused_scorer(pool: KVPool, rule, sequences: int, entries: int):
    """triton_scores when it computes this rule's scores on this pool (CUDA, a shipped
    SnapKV or R-KV scoring, half or float32 keys) faster than the rule, for an event of
    this many sequences of up to `entries` cache entries; else None."""
    method = type(rule).score_batch
    if method not in _FUSED or pool.k.dtype not in (
            torch.float16, torch.bfloat16, torch.float32):
        return None
    if sequences * entries ** 1.5 > _FUSED_MAX_WORK.get(method, float("inf")):
        return None
    return triton_module("minisparse.engine.triton_scores", pool.k)


def _compact_group(pool: KVPool, rule, rows: torch.Tensor, lens: torch.Tensor,
                   next_pos: torch.Tensor, protected: torch.Tensor, lmax: int,
                   scorer=None) -> None:
    """lmax: max(lens), known on the host (no device sync); scorer: triton_scores or
    None (the rule's select_batch)."""
    n_layers, h_kv, budget = pool.k.shape[0], pool.k.shape[2], rule.budget
    fast = triton_module("minisparse.engine.triton_compaction", pool.k)
    if scorer is not None:
        keep = _fused_select(scorer, pool, rule, rows, lens, protected, lmax)
    else:
        keep = _select(pool, rule, rows, lens, next_pos, protected, lmax, fast)
    keep = keep.view(rows.shape[0], n_layers, h_kv, budget)
    if fast:
        fast.compact_in_place(pool.k, pool.v, pool.page_table, pool.page_size, rows, keep,
                              protected)
    else:
        _pack(pool, rows, keep, protected)


def _fused_select(scorer, pool: KVPool, rule, rows: torch.Tensor, lens: torch.Tensor,
                  protected: torch.Tensor, lmax: int) -> torch.Tensor:
    """What rule.select_batch keeps, scored by triton_scores (and, per head, selected in
    the same kernel): [s * layers, H_kv, budget]."""
    args = (pool.k, pool.q_ring, pool.page_table, pool.page_size, rows, lens)
    redundancy = _FUSED[type(rule).score_batch]
    if rule.cfg.selection == "per_head":
        return scorer.keep(*args, protected, lmax, rule.cfg, redundancy)
    scores = scorer.scores(*args, lmax, rule.cfg, redundancy)
    n_layers = pool.k.shape[0]
    return rule.select_scored(scores, _per_row(lens, n_layers), _per_row(protected, n_layers))


def _select(pool: KVPool, rule, rows: torch.Tensor, lens: torch.Tensor, next_pos: torch.Tensor,
            protected: torch.Tensor, lmax: int, fast) -> torch.Tensor:
    """The rule's select_batch on the gathered keys and ring queries: [s * layers, H_kv,
    budget]."""
    n_layers, _, h_kv, d = pool.k.shape
    s = rows.shape[0]
    if fast:
        keys = fast.gather_keys(pool.k, pool.page_table, pool.page_size, rows, lens, lmax)
    else:
        keys = _gather_keys(pool, rows, lmax)
    keys = keys.view(s * n_layers, h_kv, lmax, d)
    queries = None  # rules that score without queries get none (and have no ring)
    if rule.uses_queries:
        queries = pool.ring_queries(rows, next_pos)  # [s, layers, H_q, W, D]
        queries = queries.view(s * n_layers, -1, pool.window, d)
    return rule.select_batch(keys, queries, _per_row(lens, n_layers),
                             protected=_per_row(protected, n_layers))


def _per_row(x: torch.Tensor, n_layers: int) -> torch.Tensor:
    """A value per sequence as one per (sequence, layer) row (sequence-major), in one
    copy kernel."""
    return x[:, None].expand(-1, n_layers).reshape(-1)


def _pack(pool: KVPool, rows: torch.Tensor, keep: torch.Tensor,
          first: torch.Tensor | None = None) -> None:
    """Entry first[i] + j of each (sequence rows[i], layer, head) takes what entry
    keep[i, layer, head, j] holds (keep [s, layers, H_kv, budget]; first None: 0): every
    kept row is gathered before any is written, as rows of D values read as int64 words."""
    keep = keep.permute(1, 0, 3, 2)  # [layers, s, budget, H_kv]
    entries = torch.arange(keep.shape[2], device=pool.device)[None, None, :, None]
    if first is not None:
        entries = entries + first[None, :, None, None]
    src = _flat_rows(pool, rows[None, :, None, None], keep)
    dst = _flat_rows(pool, rows[None, :, None, None], entries.expand_as(keep))
    for cache in (pool.k, pool.v):
        flat = word_rows(cache)
        flat.index_copy_(0, dst.flatten(), flat.index_select(0, src.flatten()))


def _gather_keys(pool: KVPool, rows: torch.Tensor, lmax: int) -> torch.Tensor:
    """Each (sequence, layer, head)'s keys in the order scoring reads them, [s, layers,
    H_kv, lmax, D], gathered as rows of D values (int64 words) in one index_select:
    per-element advanced indexing moved ~0.25 TB/s, and gathering pages then permuting
    copied the ~3 GB twice. Entries past a sequence's length hold whatever their slot
    holds (scoring masks them)."""
    n_layers, _, h_kv, d = pool.k.shape
    entries = torch.arange(lmax, device=pool.device)[None, None, :, None]
    index = _flat_rows(pool, rows[None, :, None, None],
                       entries.expand(n_layers, rows.shape[0], lmax, h_kv))
    index = index.permute(1, 0, 3, 2).reshape(-1)  # [s, layers, H_kv, lmax]
    keys = word_rows(pool.k).index_select(0, index)
    return keys.view(pool.k.dtype).view(rows.shape[0], n_layers, h_kv, lmax, d)


def _flat_rows(pool: KVPool, rows: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """Row of (layer, cache entry entries[l, i, j, h] of sequence rows[i], KV head h) in
    the pool viewed as [layers * slots * H_kv, D]: [layers, s, n, H_kv] like entries."""
    n_layers, slots, h_kv, _ = pool.k.shape
    slot = pool.slot_of(rows.expand_as(entries), entries)
    layer = torch.arange(n_layers, device=pool.device)[:, None, None, None]
    head = torch.arange(h_kv, device=pool.device)
    return (layer * slots + slot) * h_kv + head
