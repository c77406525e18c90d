"""Paged attention: write the step's new K/V into the pool, then attend. Decode goes to
paged_decode_attention (a Triton kernel on CUDA, a PyTorch gather elsewhere); prefill
gathers each sequence's cache through its slot list into [B, H_kv, L, D] and runs SDPA with
a causal mask (chunked prefill attends to earlier chunks the same way).

Positions play no part here: keys are stored post-RoPE, so a compacted cache (different
tokens per head, packed to the front) is attended exactly like a dense one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisparse.engine.layers.paged_decode import paged_decode_attention


@dataclass
class AttnContext:
    """Per-forward attention metadata, shared by all layers.

    slot_mapping [N]: pool slot receiving each new token's K/V.
    ring_src [M] / ring_dst [M]: queries (packed index) to keep for compression and their
        rows in the per-layer query ring (None when compression is off).
    Decode (N == B, one token per sequence): page_table [R, P], rows [B] (page-table row
    per sequence), cache_lens [B] (entries incl. the new token), max_len >= max(cache_lens).
    Prefill: gather_slots [B, L] pool slots each sequence attends to (padding -> slot 0);
    mask [B, 1, T, L] True where query t of sequence b may attend entry l; q_index [B, T] /
    token_rows [N] map between the packed token axis and the padded [B, T] grid.
    """
    slot_mapping: torch.Tensor
    ring_src: torch.Tensor | None = None
    ring_dst: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    cache_lens: torch.Tensor | None = None
    max_len: int = 0
    page_size: int = 0
    gather_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.page_table is not None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, ctx: AttnContext, scale: float) -> torch.Tensor:
    """q [N, H_q, D], k/v [N, H_kv, D]; k_cache/v_cache [slots, H_kv, D] (one layer).
    Returns the attention output [N, H_q, D]."""
    k_cache[ctx.slot_mapping] = k
    v_cache[ctx.slot_mapping] = v
    return attend(q, k_cache, v_cache, ctx, scale)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttnContext,
           scale: float) -> torch.Tensor:
    """paged_attention without the write, for callers that wrote the step's K/V already
    (the fused RoPE + cache-write kernel)."""
    if ctx.is_decode:
        return paged_decode_attention(q, k_cache, v_cache, ctx.page_table, ctx.rows,
                                      ctx.cache_lens, ctx.page_size, scale, max_len=ctx.max_len)
    return _prefill_attention(q, k_cache, v_cache, ctx, scale)


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       ctx: AttnContext, scale: float, fold: bool | None = None) -> torch.Tensor:
    """Masked SDPA of the padded [B, T] queries against each sequence's gathered cache.
    SDPA wants as many K/V heads as query heads; of the two ways to get there, the one that
    stages fewer bytes is taken (fold None): repeat K/V to the G query heads of each KV head
    (B * H_q * L * D values, twice), or fold the G query heads into the query axis, which
    needs a G-times larger mask (B * G*T * L booleans). Folding wins for short chunks over
    long caches (the tails that samples sharing a prompt prefill, T <= page_size), repeating
    for long prompts."""
    keys = k_cache[ctx.gather_slots].transpose(1, 2)  # [B, H_kv, L, D]
    values = v_cache[ctx.gather_slots].transpose(1, 2)
    (B, h_kv, L, D), T = keys.shape, ctx.q_index.shape[1]
    G = q.shape[1] // h_kv
    if fold is None:
        fold = G > 1 and T < 2 * h_kv * D * keys.element_size()
    qp = q[ctx.q_index]  # [B, T, H_q, D]
    if fold:  # [B, H_kv, G*T, D]: query row g*T + t is head h*G + g at position t
        qp = qp.view(B, T, h_kv, G, D).permute(0, 2, 3, 1, 4).reshape(B, h_kv, G * T, D)
        mask = ctx.mask.repeat(1, 1, G, 1)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=scale)
        out = out.view(B, h_kv, G, T, D).permute(0, 3, 1, 2, 4)  # [B, T, H_kv, G, D]
    else:
        if G > 1:
            keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values,
                                             attn_mask=ctx.mask, scale=scale).transpose(1, 2)
    return out.reshape(B * T, q.shape[1], D)[ctx.token_rows]
