"""Triton kernels for compaction's two copies on CUDA (compaction.py keeps the PyTorch
path, used on CPU and as the reference the tests compare against).

Why: both copies move rows of D values (256 bytes for bf16 x 128) chosen through the page
table. PyTorch's index_select / index_copy_ index element by element and need the row
index tensors built first (~12 million int64 for the keys); at a 256-sequence event of the 3B
shape they took ~15 ms for ~8 GB of traffic. Here each program resolves its pages itself
and moves whole rows:

* `gather_keys`: each (sequence, layer, entry block) reads its slots once (all KV heads of
  a slot are adjacent) and writes [s, layers, H_kv, lmax, D], the layout scoring reads.
* `ring_queries`: each (sequence, layer) reads its W ring rows (all query heads of a row
  are adjacent) and writes them in time order as [s, layers, H_q, W, D]. PyTorch's
  index_select of the same rows moved the 88 MB of a 256-sequence event of the 1.5B in
  0.42 ms, a fifth of the copy bandwidth.
* `compact_in_place`: each (sequence, layer, head) moves its kept entries to the front
  (or to just after its protected prompt entries, which stay), block by block in
  ascending order, without a staging copy. That is safe because kept indices ascend with
  index[j] >= first + j: block b only reads entries >= its own first output entry, and
  every earlier block wrote only entries below that; inside a block all rows are read
  before a barrier, then written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 32  # cache entries per program step


@triton.jit(do_not_specialize=["LMAX"], do_not_specialize_on_alignment=["ROWS", "LENS"])
def _gather_keys_kernel(K, PT, ROWS, LENS, OUT, stride_layer, stride_pt, LMAX, PS,
                        H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    i, layer, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = blk * BLOCK + tl.arange(0, BLOCK)
    ok = e < tl.load(LENS + i)
    row = tl.load(ROWS + i)
    page = tl.load(PT + row * stride_pt + e // PS, mask=ok, other=0)
    slot = page * PS + e % PS
    d = tl.arange(0, D)
    src = K + layer.to(tl.int64) * stride_layer + slot[:, None] * (H * D)
    out = OUT + ((i * tl.num_programs(1) + layer).to(tl.int64) * H * LMAX + e[:, None]) * D
    for h in tl.static_range(H):
        x = tl.load(src + h * D + d[None, :], mask=ok[:, None], other=0.0)
        tl.store(out + h * LMAX * D + d[None, :], x, mask=(e < LMAX)[:, None])


def gather_keys(k: torch.Tensor, page_table: torch.Tensor, page_size: int, rows: torch.Tensor,
                lens: torch.Tensor, lmax: int) -> torch.Tensor:
    """Keys of cache entries 0..lens[i]-1 of sequences rows[i], every layer:
    [len(rows), layers, H_kv, lmax, D], zeros past lens[i]. k [layers, slots, H_kv, D]."""
    _check(k)
    n_layers, _, h, d = k.shape
    out = torch.empty(rows.shape[0], n_layers, h, lmax, d, dtype=k.dtype, device=k.device)
    if rows.numel():
        grid = (rows.shape[0], n_layers, triton.cdiv(lmax, _BLOCK))
        _gather_keys_kernel[grid](k, page_table, rows, lens, out, k.stride(0),
                                  page_table.stride(0), lmax, page_size,
                                  H=h, D=d, BLOCK=_BLOCK)
    return out


@triton.jit(do_not_specialize_on_alignment=["ROWS", "NEXT"])
def _ring_kernel(Q, ROWS, NEXT, OUT, stride_layer, W: tl.constexpr, W_PAD: tl.constexpr,
                 HQ: tl.constexpr, D: tl.constexpr):
    i, layer = tl.program_id(0), tl.program_id(1)
    w = tl.arange(0, W_PAD)
    ok = w < W
    ring_row = tl.load(ROWS + i) * W + (tl.load(NEXT + i) + w) % W  # oldest first
    d = tl.arange(0, D)
    src = Q + layer.to(tl.int64) * stride_layer + ring_row[:, None] * (HQ * D) + d[None, :]
    out = OUT + ((i * tl.num_programs(1) + layer).to(tl.int64) * HQ * W + w[:, None]) * D
    for h in tl.static_range(HQ):
        x = tl.load(src + h * D, mask=ok[:, None])
        tl.store(out + h * W * D + d[None, :], x, mask=ok[:, None])


def ring_queries(q_ring: torch.Tensor, window: int, rows: torch.Tensor,
                 next_pos: torch.Tensor) -> torch.Tensor:
    """KVPool.ring_queries: the last `window` queries of sequences rows[i] in time order
    (next_pos[i] is the ring slot of the oldest), [len(rows), layers, H_q, window, D];
    q_ring [layers, ring rows * window, H_q, D]."""
    if not q_ring.is_contiguous():
        raise ValueError("q_ring must be contiguous [layers, ring rows * window, H_q, D]")
    n_layers, _, h_q, d = q_ring.shape
    out = torch.empty(rows.shape[0], n_layers, h_q, window, d, dtype=q_ring.dtype,
                      device=q_ring.device)
    if rows.numel():
        _ring_kernel[(rows.shape[0], n_layers)](
            q_ring, rows, next_pos, out, q_ring.stride(0), W=window,
            W_PAD=triton.next_power_of_2(window), HQ=h_q, D=d)
    return out


@triton.jit(do_not_specialize_on_alignment=["ROWS", "FIRST"])
def _compact_kernel(K, V, PT, ROWS, KEEP, FIRST, stride_layer, stride_pt, BUDGET, PS,
                    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    i, layer, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(ROWS + i)
    first = tl.load(FIRST + i)
    keep = KEEP + ((i * tl.num_programs(1) + layer) * H + h).to(tl.int64) * BUDGET
    base = layer.to(tl.int64) * stride_layer + h * D
    d = tl.arange(0, D)
    for j0 in range(0, BUDGET, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < BUDGET
        src_e = tl.load(keep + j, mask=ok, other=0)
        dst_e = first + j
        src_page = tl.load(PT + row * stride_pt + src_e // PS, mask=ok, other=0)
        dst_page = tl.load(PT + row * stride_pt + dst_e // PS, mask=ok, other=0)
        src = base + (src_page * PS + src_e % PS)[:, None] * (H * D) + d[None, :]
        dst = base + (dst_page * PS + dst_e % PS)[:, None] * (H * D) + d[None, :]
        kx = tl.load(K + src, mask=ok[:, None])
        vx = tl.load(V + src, mask=ok[:, None])
        tl.debug_barrier()  # every row of the block read before any is overwritten
        tl.store(K + dst, kx, mask=ok[:, None])
        tl.store(V + dst, vx, mask=ok[:, None])


def compact_in_place(k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                     page_size: int, rows: torch.Tensor, keep: torch.Tensor,
                     first: torch.Tensor | None = None) -> None:
    """For each sequence rows[i], layer l and KV head h, make cache entry first[i] + j hold
    what entry keep[i, l, h, j] held, for j < budget (first None: 0; entries below it stay).
    keep [len(rows), layers, H_kv, budget] ascending along the last dim with
    keep[i, ..., j] >= first[i] + j."""
    _check(k, v)
    n_layers, _, h, d = k.shape
    budget = keep.shape[-1]
    if rows.numel():
        keep = keep.contiguous()
        if first is None:
            first = torch.zeros_like(rows)
        _compact_kernel[(rows.shape[0], n_layers, h)](
            k, v, page_table, rows, keep, first.to(torch.long).contiguous(), k.stride(0),
            page_table.stride(0), budget, page_size, H=h, D=d, BLOCK=_BLOCK)


def _check(k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    if not k.is_contiguous() or (v is not None and (not v.is_contiguous() or v.shape != k.shape)):
        raise ValueError("cache: k and v must be contiguous [layers, slots, H_kv, D] of one shape")
