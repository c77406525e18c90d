"""Token scores for KV eviction, batched over rows (a row is one sequence in one layer).

Every function takes padded keys [B, H_kv, Lmax, D] plus the true lengths [B] and treats
positions >= lengths[b] as absent: they are masked with `masked_fill` (never multiplied
by zero) so that garbage, inf or NaN in the padding cannot leak into a row's scores.
Matmuls whose outputs are bounded and only compared coarsely (cosine similarities) run in
the input dtype; attention logits, softmaxes, means and pooling run in float32 (or
float64 for float64 inputs), as the attention kernels themselves do.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minisparse.utils.kernels import triton_module

NORM_EPS = 1e-8


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, float64 stays float64: the dtype of softmaxes and sums."""
    return torch.promote_types(dtype, torch.float32)


def position_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """[B, size] bool, True where position < lengths[b] (a real token of row b)."""
    positions = torch.arange(size, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def attention_importance(
    keys: torch.Tensor,
    queries: torch.Tensor,
    lengths: torch.Tensor,
    kernel_size: int,
    pooling: str,
    group_pooling: str,
) -> torch.Tensor:
    """How much the last W queries attend to each older token: [B, H_kv, Lmax].

    Row b scores its N_b = lengths[b] - W older tokens (positions >= N_b come out as 0,
    the caller masks them). Logits are pooled over the query heads of a KV group before
    the softmax over the N_b keys, averaged over the W queries, then pooled along the
    tokens (kernel_size, stride 1, padding kernel_size // 2; average pooling counts the
    padding, as F.avg_pool1d does by default).
    """
    rows, h_kv, lmax, dim = keys.shape
    h_q, window = queries.shape[1], queries.shape[2]
    group = h_q // h_kv
    acc = accumulate_dtype(keys.dtype)
    # Query head h serves KV head h // group (the repeat_kv layout of HF GQA models).
    q = queries.reshape(rows * h_kv, group * window, dim)
    k = keys.reshape(rows * h_kv, lmax, dim).transpose(1, 2)
    logits = _bmm_acc(q, k, acc).view(rows, h_kv, group, window, lmax)
    logits = logits.amax(dim=2) if group_pooling == "max" else logits.mean(dim=2)
    # Scaled after pooling the group (8x fewer elements); for max pooling the result is
    # bitwise the same, as division by a positive constant is monotone.
    logits /= math.sqrt(dim)
    older = position_mask(lengths - window, lmax)[:, None, None, :]
    logits = logits.masked_fill(~older, float("-inf"))
    attn = torch.softmax(logits, dim=-1).mean(dim=2)  # [B, H_kv, Lmax], 0 past N_b
    # Zeros past N_b act as padding: below every probability for max pooling, and
    # exactly the zero padding that average pooling counts.
    pad = kernel_size // 2
    if pooling == "max":
        return F.max_pool1d(attn, kernel_size, stride=1, padding=pad)
    return F.avg_pool1d(attn, kernel_size, stride=1, padding=pad)


def _bmm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b (3-D) with a float32 (accumulate dtype) result. Half-precision CUDA inputs use
    a half GEMM with float32 output (the same products and fp32 sums as upcasting first,
    without the float32 copies); elsewhere the inputs are upcast."""
    if a.dtype != acc and a.is_cuda:
        try:
            return torch.bmm(a, b, out_dtype=acc)
        except (TypeError, RuntimeError, NotImplementedError):  # older PyTorch
            pass
    return torch.bmm(a.to(acc), b.to(acc))


def redundancy(keys: torch.Tensor, lengths: torch.Tensor, sim_threshold: float) -> torch.Tensor:
    """R-KV's redundancy of each token among the row's L_b keys: [B, H_kv, Lmax].

    Cosine similarities S of the keys with the diagonal zeroed; in each row i the newest
    j with S[i, j] > sim_threshold (j = 0 when none) has S[i, j] zeroed, so the newest
    near-duplicate of a token is not penalised; column means over the L_b rows, then a
    softmax over the L_b columns. Positions >= L_b come out as 0.

    The column sums are formed algebraically (see column_sums_torch): the threshold test
    reads the similarities in the input dtype, the sums run in the accumulate dtype.
    """
    acc = accumulate_dtype(keys.dtype)
    valid = position_mask(lengths, keys.shape[2])  # [B, Lmax]
    fast = _redundancy_kernels(keys)
    if fast is not None:
        sums = fast.column_sums(keys, lengths, sim_threshold, NORM_EPS)
    else:
        sums = column_sums_torch(keys, lengths, sim_threshold)
    means = sums / lengths.to(acc)[:, None, None]
    means = means.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.softmax(means, dim=-1)


def uses_triton(keys: torch.Tensor) -> bool:
    """Whether redundancy() runs the Triton kernels (CUDA, half or float32, Triton there)."""
    return _redundancy_kernels(keys) is not None


def _redundancy_kernels(keys: torch.Tensor):
    """triton_redundancy for CUDA keys of a dtype it takes, else None (the PyTorch path)."""
    if keys.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    return triton_module("minisparse.compression.triton_redundancy", keys)


def column_sums_torch(keys: torch.Tensor, lengths: torch.Tensor,
                      sim_threshold: float) -> torch.Tensor:
    """Column sums [B, H_kv, Lmax] (accumulate dtype) of the similarity matrix with the
    diagonal and each row's last entry above the threshold zeroed; 0 past lengths[b].

    With u the unit keys (0 for padding), sum_i S[i, j] over i != j is
    u_j . (sum_i u_i) - u_j . u_j, a matrix-vector product; each row i then subtracts the
    one entry it zeroes, S[i, last(i)], from column last(i). Only last(i) needs the L x L
    matrix, which is built in the input dtype against the keys reversed in position, so
    that "last entry above" becomes "first entry above": a one-byte argmax.
    """
    acc = accumulate_dtype(keys.dtype)
    valid = position_mask(lengths, keys.shape[2])  # [B, Lmax]
    k = keys.to(acc).masked_fill(~valid[:, None, :, None], 0.0)
    unit = k / (k.norm(dim=-1, keepdim=True) + NORM_EPS)
    del k
    total = unit.sum(dim=-2, keepdim=True)  # [B, H, 1, D]
    sums = torch.matmul(unit, total.transpose(-1, -2)).squeeze(-1)
    sums -= unit.square().sum(dim=-1)
    last, dropped = last_above(unit.to(keys.dtype), lengths, sim_threshold)
    sums.scatter_add_(-1, last, -dropped.to(acc))
    return sums


def last_above(unit: torch.Tensor, lengths: torch.Tensor,
               threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For S = unit unit^T (input dtype) with the diagonal zeroed: per row i the last
    j < lengths[b] with S[i, j] > threshold (0 when none) and the value S[i, j].

    unit [B, H, Lmax, D] must be 0 past lengths[b]. Returns (LongTensor, input-dtype
    tensor), both [B, H, Lmax]; rows past lengths[b] give value 0.
    The matrix is computed against the reversed positions (column c is position
    Lmax - 1 - c), so the search is an argmax (the first maximum) of a one-byte mask.
    """
    lmax = unit.shape[-2]
    sim = torch.matmul(unit, unit.flip(-2).transpose(-1, -2))  # [B, H, Lmax, Lmax]
    # The diagonal of S is the anti-diagonal of the reversed matrix.
    anti = sim.as_strided(sim.shape[:-1], sim.stride()[:-2] + (sim.stride(-2) - sim.stride(-1),),
                          sim.storage_offset() + (lmax - 1) * sim.stride(-1))
    anti.zero_()
    above = sim > threshold
    if threshold < 0:  # zero similarities with padding would count as above
        pad = torch.arange(lmax, device=unit.device) < (lmax - lengths)[:, None]
        above.masked_fill_(pad[:, None, None, :], False)
    first = above.view(torch.uint8).argmax(dim=-1, keepdim=True)
    found = above.gather(-1, first)
    first = torch.where(found, first, lmax - 1)  # none above: position 0
    value = sim.gather(-1, first).squeeze(-1)
    return (lmax - 1) - first.squeeze(-1), value
