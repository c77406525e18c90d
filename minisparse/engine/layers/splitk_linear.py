"""A split-K Triton GEMM for the decode step's narrow projections (o_proj and down_proj),
whose partial sums the next residual-add + RMSNorm kernel reduces (fused_ops.add_rms_norm).

Why: at decode batch sizes (M <= a few hundred) these products have N = hidden (2,048 for
the 3B shape): a 128 x 128 output tiling gives 32 tiles for 132 SMs, so cuBLAS splits K
and launches a reduce kernel of its own. Here each (M tile, N tile, K slice) program writes
a float32 partial product and the add + RMSNorm that follows anyway sums the slices in a
fixed order: the reduce launch goes, and the down projection can compute SiLU(gate) * up
on the fly from the fused gate/up product (one more launch and a [M, I] round trip gone).
The roundings are the PyTorch path's: silu in float32 rounded to the model dtype, times up
rounded again; the product accumulated in float32 and rounded once, after the reduction.

`plan()` says when to use it and with which tiling (measured on an H200, see
docs/benchmarks.md); outside its range the engine keeps cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SplitPlan:
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _linear_parts_kernel(A, W, OUT, M, N, K, k_per_split, stride_am, stride_wn,
                         SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[s] = A[:, slice s] @ W[:, slice s].T in float32. With SILU_MUL, A is the fused
    [gate | up] product ([M, 2K]) and the operand is silu(gate) * up."""
    pid_m, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    rows = A + offs_m[:, None].to(tl.int64) * stride_am
    cols = W + offs_n[:, None].to(tl.int64) * stride_wn
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + offs_k[None, :]
        a_ok, w_ok = m_ok, n_ok
        if not EVEN_K:
            a_ok, w_ok = m_ok & (kk < k_end), n_ok & (kk < k_end)
        a = tl.load(rows + kk, mask=a_ok, other=0.0)
        if SILU_MUL:
            up = tl.load(rows + K + kk, mask=a_ok, other=0.0)
            g = a.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(A.dtype.element_ty)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(A.dtype.element_ty)
        w = tl.load(cols + kk, mask=w_ok, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    out = OUT + s.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=m_ok & (offs_n[None, :] < N))


def linear_parts(a: torch.Tensor, weight: torch.Tensor, p: SplitPlan,
                 silu_mul: bool = False) -> torch.Tensor:
    """Float32 partial products [splits, M, N] of a [M, K] (or silu_mul: [M, 2K] = [gate |
    up]) times weight [N, K]^T; their sum over dim 0 is the product. a's rows and weight
    must be contiguous in K."""
    M = a.shape[0]
    N, K = weight.shape
    if a.shape[1] != (2 * K if silu_mul else K) or a.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"linear_parts: a {tuple(a.shape)} does not match weight "
                         f"{tuple(weight.shape)} (silu_mul={silu_mul}) or is not K-contiguous")
    k_per_split = triton.cdiv(triton.cdiv(K, p.splits), p.block_k) * p.block_k
    splits = triton.cdiv(K, k_per_split)
    out = torch.empty(splits, M, N, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(M, p.block_m), triton.cdiv(N, p.block_n), splits)
    if M:
        _linear_parts_kernel[grid](a, weight, out, M, N, K, k_per_split, a.stride(0),
                                   weight.stride(0), SILU_MUL=silu_mul,
                                   EVEN_K=K % p.block_k == 0,
                                   BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
                                   num_warps=p.num_warps, num_stages=p.num_stages)
    return out
