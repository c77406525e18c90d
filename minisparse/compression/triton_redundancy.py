"""Triton kernels for R-KV's redundancy term, so the L x L similarity matrix is never stored.

The redundancy of token j is the mean over rows i of S[i, j] = u_i . u_j (u = unit keys),
with the diagonal and, per row i, the entry at last(i) (the newest j with S[i, j] >
sim_threshold, 0 when none) zeroed. Summed over i:

    col[j] = u_j . (sum_i u_i) - u_j . u_j - sum_{i : last(i) = j} S[i, j]   (i != j)

so the only L x L work is finding last(i) and the value S[i, last(i)]:

* `_norms_sums_kernel`, one program per (row, KV head): the key norms, the float32 sum of
  the unit keys, then col[j] without the dropped entries (two passes over L; the second
  re-reads the keys, mostly from L2).
* `_last_above_kernel`, one program per (row, KV head, block of BLOCK_M query tokens):
  walks the key blocks from the newest down, computing S tiles with tl.dot on the unit
  keys rounded to the input dtype and S rounded to the input dtype (exactly what the
  PyTorch path compares: a bf16 GEMM with fp32 accumulation and a bf16 output), and stops
  as soon as every token of its block has found its last entry above the threshold.

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
_BLOCK_M = 64  # query tokens per program of the last-above kernel
_BLOCK_N = 64  # key tokens per step of the last-above kernel


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE (to nearest, ties to even), returned as float32. bf16
    rounds through the bits: Triton 3.6's interpreter truncates float32 -> bf16 casts."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _norms_sums_kernel(K, LENS, DEN, SUMS, eps, stride_kb, stride_kh, stride_kl, H, LMAX,
                       D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_L: tl.constexpr):
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


@triton.jit
def _last_above_kernel(K, LENS, DEN, LAST, DROP, threshold, stride_kb, stride_kh, stride_kl,
                       H, LMAX, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    bh = tl.program_id(0)
    mb = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(LENS + b).to(tl.int32)
    base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    out = bh.to(tl.int64) * LMAX
    d = tl.arange(0, D_PAD)
    dmask = d < D
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    k = tl.load(base + rows[:, None].to(tl.int64) * stride_kl + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    den = tl.load(DEN + out + rows, mask=row_ok, other=1.0)
    # The unit keys in the input dtype, as the PyTorch path rounds them.
    q = _round(k.to(tl.float32) / den[:, None], K.dtype.element_ty)
    if not IEEE:
        q = q.to(K.dtype.element_ty)  # exact: q is already representable
    best = tl.full([BLOCK_M], -1, tl.int32)
    best_val = tl.zeros([BLOCK_M], tl.float32)
    first_val = tl.zeros([BLOCK_M], tl.float32)  # S[i, 0]: dropped when none is above
    n0 = ((length - 1) // BLOCK_N) * BLOCK_N
    n0 = tl.where(mb * BLOCK_M < length, n0, -1)
    while n0 >= 0:
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        kc = tl.load(base + cols[:, None].to(tl.int64) * stride_kl + d[None, :],
                     mask=col_ok[:, None] & dmask[None, :], other=0.0)
        dc = tl.load(DEN + out + cols, mask=col_ok, other=1.0)
        kc = _round(kc.to(tl.float32) / dc[:, None], K.dtype.element_ty)
        if IEEE:
            s = tl.dot(q, tl.trans(kc), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kc.to(K.dtype.element_ty)))
        s = _round(s, K.dtype.element_ty)  # the similarity in the input dtype
        s = tl.where(cols[None, :] == rows[:, None], 0.0, s)  # zeroed diagonal
        above = (s > threshold) & col_ok[None, :]
        block_last = tl.max(tl.where(above, cols[None, :], -1), axis=1)
        block_val = tl.sum(tl.where(cols[None, :] == block_last[:, None], s, 0.0), axis=1)
        first_val += tl.sum(tl.where(cols[None, :] == 0, s, 0.0), axis=1)
        new = (best < 0) & (block_last >= 0)
        best = tl.where(new, block_last, best)
        best_val = tl.where(new, block_val, best_val)
        done = tl.min(tl.where(row_ok, best, 0), axis=0) >= 0
        n0 = tl.where(done, -1, n0 - BLOCK_N)
    found = best >= 0
    keep = rows < LMAX
    tl.store(LAST + out + rows, tl.where(found, best, 0).to(tl.int64), mask=keep)
    tl.store(DROP + out + rows, tl.where(found, best_val, first_val), mask=keep)


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
    d_pad = max(16, triton.next_power_of_2(dim))
    strides = (keys.stride(0), keys.stride(1), keys.stride(2))
    _norms_sums_kernel[(rows * h_kv,)](keys, lengths, den, sums, eps, *strides, h_kv, lmax,
                                       D=dim, D_PAD=d_pad, BLOCK_L=_BLOCK_L)
    ieee = keys.dtype == torch.float32 or not keys.is_cuda
    _last_above_kernel[(rows * h_kv, triton.cdiv(lmax, _BLOCK_M))](
        keys, lengths, den, last, drop, float(sim_threshold), *strides, h_kv, lmax,
        D=dim, D_PAD=d_pad, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, IEEE=ieee)
    sums.scatter_add_(-1, last, -drop)
    return sums
