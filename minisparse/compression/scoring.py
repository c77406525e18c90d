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
    q = queries.to(acc).reshape(rows, h_kv, group * window, dim)
    logits = torch.matmul(q, keys.to(acc).transpose(-1, -2)) / math.sqrt(dim)
    logits = logits.view(rows, h_kv, group, window, lmax)
    logits = logits.amax(dim=2) if group_pooling == "max" else logits.mean(dim=2)
    older = position_mask(lengths - window, lmax)[:, None, None, :]
    logits = logits.masked_fill(~older, float("-inf"))
    attn = torch.softmax(logits, dim=-1).mean(dim=2)  # [B, H_kv, Lmax], 0 past N_b
    # Zeros past N_b act as padding: below every probability for max pooling, and
    # exactly the zero padding that average pooling counts.
    pad = kernel_size // 2
    if pooling == "max":
        return F.max_pool1d(attn, kernel_size, stride=1, padding=pad)
    return F.avg_pool1d(attn, kernel_size, stride=1, padding=pad)


def redundancy(keys: torch.Tensor, lengths: torch.Tensor, sim_threshold: float) -> torch.Tensor:
    """R-KV's redundancy of each token among the row's L_b keys: [B, H_kv, Lmax].

    Cosine similarities S of the keys with the diagonal zeroed; in each row i the newest
    j with S[i, j] > sim_threshold (j = 0 when none) has S[i, j] zeroed, so the newest
    near-duplicate of a token is not penalised for it; column means over the L_b rows,
    then a softmax over the L_b columns. Positions >= L_b come out as 0.
    """
    acc = accumulate_dtype(keys.dtype)
    lmax = keys.shape[2]
    valid = position_mask(lengths, lmax)  # [B, Lmax]
    k = keys.to(acc)
    unit = k / (k.norm(dim=-1, keepdim=True) + NORM_EPS)
    # Zeroed padding keys give zero rows and columns: never above the threshold and
    # nothing added to any column sum.
    unit = unit.masked_fill(~valid[:, None, :, None], 0.0).to(keys.dtype)
    sim = torch.matmul(unit, unit.transpose(-1, -2))  # [B, H, Lmax, Lmax], input dtype
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    newest = _last_above(sim, sim_threshold)  # [B, H, Lmax]
    column_sums = sim.sum(dim=-2, dtype=acc)
    dropped = sim.gather(-1, newest.unsqueeze(-1)).squeeze(-1).to(acc)
    column_sums.scatter_add_(-1, newest, -dropped)
    del sim
    means = column_sums / lengths.to(acc)[:, None, None]
    means = means.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.softmax(means, dim=-1)


def _last_above(sim: torch.Tensor, threshold: float) -> torch.Tensor:
    """Index of the last entry > threshold along the last dim, 0 where there is none.

    Works on a flipped one-byte mask (argmax returns the first maximum) so the peak
    memory stays at about two bytes per similarity entry beyond sim itself; whether a
    row has any entry above is read back at its argmax instead of in another full pass.
    """
    flipped = (sim > threshold).flip(-1).view(torch.uint8)
    first = flipped.argmax(dim=-1, keepdim=True)
    found = flipped.gather(-1, first).squeeze(-1).bool()
    last = (sim.shape[-1] - 1) - first.squeeze(-1)
    return torch.where(found, last, torch.zeros_like(last))
