"""Triton kernels for R-KV's redundancy term, so the L x L similarity matrix is never stored.

The redundancy of token j is the mean over rows i of S[i, j] = u_i . u_j (u = unit keys),
with the diagonal and, per row i, the entry at last(i) (the newest j with S[i, j] >
sim_threshold, 0 when none) zeroed. Summed over i:

    col[j] = u_j . (sum_i u_i) - u_j . u_j - sum_{i : last(i) = j} S[i, j]   (i != j)

so the only L x L work is finding last(i) and the value S[i, last(i)]:

* `_norms_sums_kernel`, one program per (row, KV head): the key norms, the float32 sum of
  the unit keys, then col[j] without the dropped entries (two passes over L; the second
  re-reads the keys, mostly from L2), and the unit keys rounded to the input dtype, written
  once (a scratch copy the size of the keys) instead of renormalised in every tile below.
* `_last_above_kernel`, one program per (row, KV head, block of BLOCK_M query tokens):
  walks the key blocks from the newest down (the next block's load issued before this
  block's tile is computed), computing S tiles with tl.dot on those unit keys and S
  rounded to the input dtype (exactly what the PyTorch path compares: a bf16 GEMM with
  fp32 accumulation and a bf16 output), and stops as soon as every token of its block has
  found its last entry above the threshold.

Padding (positions >= lengths[b]) is never read: every load is masked. fp32 inputs, and
every input under the CPU interpreter (whose bf16/fp16 tl.dot is wrong in Triton 3.6),
use exact fp32 dots of the (rounded) values, which equal the products a half-precision
tensor-core dot accumulates in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_L = 64  # tokens per step of the norms / sums kernel
_BLOCK_M = 128  # query tokens per program of the last-above kernel
_BLOCK_N = 32  # key tokens per step of the last-above kernel
_WARPS = 4


@triton.jit
def round_as(x, DTYPE: tl.constexpr, HW: tl.constexpr):
    """float32 x rounded to DTYPE (to nearest, ties to even), returned as float32. Compiled
    (HW) that is the hardware conversion; the interpreter truncates float32 -> bf16 casts
    (Triton 3.6), so there bf16 rounds through the bits."""
    if HW:
        return x.to(DTYPE).to(tl.float32)
    elif DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["LMAX"], do_not_specialize_on_alignment=["LENS"])
def _norms_sums_kernel(K, LENS, DEN, SUMS, UNIT, eps, stride_kb, stride_kh, stride_kl, H, LMAX,
                       D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_L: tl.constexpr,
                       HW: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    length = tl.load(LENS + b).to(tl.int32)
    base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    out = bh.to(tl.int64) * LMAX
    d = tl.arange(0, D_PAD)
    dmask = d < D
    total = tl.zeros([D_PAD], tl.float32)
    for l0 in range(0, length, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        valid = pos < length
        k = tl.load(base + pos[:, None].to(tl.int64) * stride_kl + d[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        den = tl.sqrt(tl.sum(k * k, axis=1)) + eps
        tl.store(DEN + out + pos, den, mask=valid)
        total += tl.sum(k / den[:, None], axis=0)
    for l0 in range(0, length, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        valid = pos < length
        k = tl.load(base + pos[:, None].to(tl.int64) * stride_kl + d[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        den = tl.load(DEN + out + pos, mask=valid, other=1.0)
        u = k / den[:, None]
        col = tl.sum(u * total[None, :], axis=1) - tl.sum(u * u, axis=1)
        tl.store(SUMS + out + pos, col, mask=valid)
        # exact in UNIT's dtype once rounded (the interpreter's truncating cast included)
        tl.store(UNIT + (out + pos)[:, None] * D + d[None, :],
                 round_as(u, UNIT.dtype.element_ty, HW).to(UNIT.dtype.element_ty),
                 mask=valid[:, None] & dmask[None, :])


@triton.jit
def _unit_tile(UNIT, out, pos, ok, d, dmask, D: tl.constexpr, IEEE: tl.constexpr):
    """Rows pos of the unit keys (rounded to the input dtype by the norms kernel): float32
    for IEEE dots, else in the input dtype."""
    u = tl.load(UNIT + (out + pos)[:, None] * D + d[None, :], mask=ok[:, None] & dmask[None, :],
                other=0.0)
    if IEEE:
        return u.to(tl.float32)
    else:
        return u


@triton.jit
def newest_above(s, cols, col_ok, threshold, best, best_val):
    """One step of the search from the newest key block down: rows of the similarity tile
    s (columns cols) that have no column above the threshold yet (best < 0) take their
    newest one here and its similarity (best, best_val updated)."""
    above = (s > threshold) & col_ok[None, :]
    block_last = tl.max(tl.where(above, cols[None, :], -1), axis=1)
    new = (best < 0) & (block_last >= 0)
    if tl.max(new.to(tl.int32), axis=0) > 0:
        block_val = tl.sum(tl.where(cols[None, :] == block_last[:, None], s, 0.0), axis=1)
        best = tl.where(new, block_last, best)
        best_val = tl.where(new, block_val, best_val)
    return best, best_val


@triton.jit(do_not_specialize=["LMAX"], do_not_specialize_on_alignment=["LENS"])
def _last_above_kernel(UNIT, LENS, LAST, DROP, threshold, H, LMAX, D: tl.constexpr,
                       D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IEEE: tl.constexpr, HW: tl.constexpr):
    bh = tl.program_id(0)
    mb = tl.program_id(1)
    length = tl.load(LENS + bh // H).to(tl.int32)
    out = bh.to(tl.int64) * LMAX
    d = tl.arange(0, D_PAD)
    dmask = d < D
    DT = UNIT.dtype.element_ty
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    q = _unit_tile(UNIT, out, rows, row_ok, d, dmask, D, IEEE)
    best = tl.full([BLOCK_M], -1, tl.int32)
    best_val = tl.zeros([BLOCK_M], tl.float32)
    first_val = tl.zeros([BLOCK_M], tl.float32)  # S[i, 0]: dropped when none is above
    n0 = ((length - 1) // BLOCK_N) * BLOCK_N
    n0 = tl.where(mb * BLOCK_M < length, n0, -1)
    cols = n0 + tl.arange(0, BLOCK_N)
    kc = _unit_tile(UNIT, out, cols, (cols < length) & (cols >= 0), d, dmask, D, IEEE)
    while n0 >= 0:
        # The next (older) block's keys load while this block's tile is computed.
        nxt = n0 - BLOCK_N + tl.arange(0, BLOCK_N)
        kc_next = _unit_tile(UNIT, out, nxt, nxt >= 0, d, dmask, D, IEEE)
        cols = n0 + tl.arange(0, BLOCK_N)
        if IEEE:
            s = tl.dot(q, tl.trans(kc), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kc))
        s = round_as(s, DT, HW)  # the similarity in the input dtype
        if (n0 < mb * BLOCK_M + BLOCK_M) & (n0 + BLOCK_N > mb * BLOCK_M):
            s = tl.where(cols[None, :] == rows[:, None], 0.0, s)  # zeroed diagonal
        best, best_val = newest_above(s, cols, cols < length, threshold, best, best_val)
        if n0 == 0:
            first_val = tl.sum(tl.where(cols[None, :] == 0, s, 0.0), axis=1)
        done = tl.min(tl.where(row_ok, best, 0), axis=0) >= 0
        n0 = tl.where(done, -1, n0 - BLOCK_N)
        kc = kc_next
    found = best >= 0
    keep = rows < LMAX
    tl.store(LAST + out + rows, tl.where(found, best, 0).to(tl.int64), mask=keep)
    tl.store(DROP + out + rows, tl.where(found, best_val, first_val), mask=keep)


def threshold_as(sim_threshold: float, dtype: torch.dtype) -> float:
    """sim_threshold rounded to the similarities' dtype, as the PyTorch path compares
    them (a bfloat16 tensor > 0.3 compares against bfloat16's 0.30078125)."""
    return float(torch.tensor(sim_threshold, dtype=dtype))


def column_sums(keys: torch.Tensor, lengths: torch.Tensor, sim_threshold: float,
                eps: float) -> torch.Tensor:
    """Column sums [B, H_kv, Lmax] (float32) of R-KV's similarity matrix after zeroing the
    diagonal and each row's last entry above the threshold; 0 past lengths[b]."""
    rows, h_kv, lmax, dim = keys.shape
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    lengths = lengths.to(device=keys.device, dtype=torch.int32).contiguous()
    den = torch.ones(rows, h_kv, lmax, device=keys.device, dtype=torch.float32)
    sums = torch.zeros_like(den)
    last = torch.empty(rows, h_kv, lmax, device=keys.device, dtype=torch.long)
    drop = torch.empty_like(den)
    unit = torch.empty_like(keys, memory_format=torch.contiguous_format)
    d_pad = max(16, triton.next_power_of_2(dim))
    strides = (keys.stride(0), keys.stride(1), keys.stride(2))
    _norms_sums_kernel[(rows * h_kv,)](keys, lengths, den, sums, unit, eps, *strides, h_kv,
                                       lmax, D=dim, D_PAD=d_pad, BLOCK_L=_BLOCK_L,
                                       HW=keys.is_cuda)
    ieee = keys.dtype == torch.float32 or not keys.is_cuda
    _last_above_kernel[(rows * h_kv, triton.cdiv(lmax, _BLOCK_M))](
        unit, lengths, last, drop, threshold_as(sim_threshold, keys.dtype), h_kv, lmax, D=dim,
        D_PAD=d_pad, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, IEEE=ieee, HW=keys.is_cuda,
        num_warps=_WARPS)
    sums.scatter_add_(-1, last, -drop)
    return sums
