"""Paged attention: write the step's new K/V into the pool, then attend. Decode goes to
paged_decode_attention (a Triton kernel on CUDA, a PyTorch gather elsewhere); prefill
gathers each sequence's cache through its slot list into [B, H_kv, L, D] and runs SDPA with
a causal mask (chunked prefill attends to earlier chunks the same way).

Positions play no part here: keys are stored post-RoPE, so a compacted cache (different
tokens per head, packed to the front) is attended exactly like a dense one.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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
                       ctx: AttnContext, scale: float) -> torch.Tensor:
    """Masked SDPA of the padded [B, T] queries against each sequence's gathered cache.
    K/V are repeated to the query heads (B*H_q*L*D) rather than folding G into the query
    axis, which would need a G-times larger [B, G*T, L] mask."""
    keys = k_cache[ctx.gather_slots].transpose(1, 2)  # [B, H_kv, L, D]
    values = v_cache[ctx.gather_slots].transpose(1, 2)
    G = q.shape[1] // keys.shape[1]
    if G > 1:
        keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
    qp = q[ctx.q_index].transpose(1, 2)  # [B, H_q, T, D]
    with prefill_sdpa(q.device):
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=ctx.mask, scale=scale)
    return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[ctx.token_rows]


def prefill_sdpa(device: torch.device):
    """The SDPA kernels a prefill step may take on CUDA: the memory-efficient one (math
    where it cannot run). torch picks cuDNN's for a masked call first, and cuDNN builds a
    plan for each new (B, T, L), which nearly every prefill step of a rollout on new
    prompts is: 67-86 ms a step against 20-32 ms in a 1,024-sample rollout of the real
    1.5B on an H200 (docs/benchmarks.md, "A prefill step's attention kernel")."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
