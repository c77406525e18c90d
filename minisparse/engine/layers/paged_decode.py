"""Decode attention over the paged KV pool, one entry point for every device.

paged_decode_attention runs the Triton kernel (triton_decode) for CUDA tensors when Triton
imports, and otherwise a PyTorch reference that gathers the cache (fine on CPU, where the
engine runs tiny models in tests). The Triton module is imported lazily, on the first CUDA
call (minisparse.utils.kernels).
"""
from __future__ import annotations

import torch

from minisparse.utils.kernels import triton_module


def triton_kernels(x: torch.Tensor):
    """The triton_decode module for CUDA tensors, None elsewhere or without Triton."""
    return triton_module("minisparse.engine.layers.triton_decode", x)


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, rows: torch.Tensor,
                           cache_lens: torch.Tensor, page_size: int, scale: float, *,
                           max_len: int | None = None) -> torch.Tensor:
    """Same contract as paged_decode_attention: gather entries 0..max_len-1 through the page
    table, mask those at or past cache_lens, softmax in fp32. Sequences with cache_len 0
    get zeros (as in the kernel)."""
    B, h_q, D = q.shape
    h_kv = k_cache.shape[1]
    L = int(cache_lens.max()) if max_len is None else max_len
    L = max(L, 1)
    j = torch.arange(L, device=q.device)
    pages = (j // page_size).clamp_(max=page_table.shape[1] - 1)
    slots = page_table[rows.long()][:, pages] * page_size + j % page_size  # [B, L]
    valid = j[None, :] < cache_lens[:, None].long()
    slots = torch.where(valid, slots, 0)
    keys = k_cache[slots].float()  # [B, L, H_kv, D]
    values = v_cache[slots].float()
    qg = q.float().view(B, h_kv, h_q // h_kv, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # all-masked rows -> 0
    values = torch.where(valid[:, :, None, None], values, 0.0)  # poisoned pads never leak
    out = torch.einsum("bhgl,blhd->bhgd", probs, values)
    return out.reshape(B, h_q, D).to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, rows: torch.Tensor,
                           cache_lens: torch.Tensor, page_size: int, scale: float, *,
                           max_len: int | None = None) -> torch.Tensor:
    """q [B, H_q, D] (query heads h*G..h*G+G-1 share KV head h); k/v_cache [S, H_kv, D] of
    one layer; page_table [R, P] page ids; rows [B] page-table row of each query; cache_lens
    [B] valid entries including the token just written. Returns [B, H_q, D] in q's dtype.
    max_len (host-side bound on cache_lens) avoids a device->host sync; pass it when known."""
    impl = triton_kernels(q)
    if impl:
        return impl.paged_decode_attention(q, k_cache, v_cache, page_table, rows, cache_lens,
                                           page_size, scale, max_len=max_len)
    return paged_decode_reference(q, k_cache, v_cache, page_table, rows, cache_lens,
                                  page_size, scale, max_len=max_len)
