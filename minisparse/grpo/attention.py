"""Packed variable-length causal attention for the training passes (log-probs, update).

A micro-batch is one row of several sequences back to back (logprobs.py). Under "sdpa"
transformers builds a dense [L, L] block-diagonal mask for such a row and SDPA then runs
a masked kernel over all L² pairs, the cross-sequence ones included. Here the
sequences' boundaries (cu_seqlens) go to the attention directly:

* CUDA: torch's own flash-attention varlen kernel (`torch.nn.attention.varlen`), which
  visits only each sequence's causal triangle and has a backward;
* otherwise (CPU, or a torch without it): one causal SDPA call per sequence.

No mask is built (transformers builds none for an attention it has no mask
function for). A call without packing
information (one sequence per row) is plain causal SDPA.
"""

from __future__ import annotations

import inspect
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F

from minisparse.config.schema import Attention, choices

NAME = "minisparse_varlen"


def packing_kwargs(lengths: list[int], device: torch.device) -> dict:
    """What the model's forward passes on to the attention for sequences of these lengths
    packed into one row (transformers hands unknown forward kwargs to the attention)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return {
        "packed_cu_seqlens": cu.to(device, non_blocking=True),
        "packed_max_seqlen": max(lengths),
        "packed_lengths": tuple(lengths),
    }


@lru_cache(maxsize=1)
def _varlen_fn():
    """(varlen_attn, extra kwargs for causal GQA), or None where torch lacks it or it
    fails a first call on two short sequences against per-sequence SDPA (a warning says
    so). The keyword for causality changed between torch releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        warnings.warn("torch has no nn.attention.varlen: packed attention runs per sequence")
        return None
    params = inspect.signature(varlen_attn).parameters
    extra = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    try:
        q, k, v = (torch.randn(1, h, 24, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
        cu = torch.tensor([0, 9, 24], dtype=torch.int32, device="cuda")
        out = varlen_attn(*(t[0].transpose(0, 1).contiguous() for t in (q, k, v)), cu, cu, 15, 15,
                          scale=0.125, **extra)
        ref = _per_sequence_sdpa(q, k, v, (9, 15), 0.125)[0].transpose(0, 1)
        if not (out.float() - ref.float()).norm() <= 1e-2 * ref.float().norm():
            raise RuntimeError("result differs from per-sequence SDPA")
    except (RuntimeError, TypeError) as exc:
        warnings.warn(f"torch varlen_attn unusable ({exc}): packed attention runs per sequence")
        return None
    return varlen_attn, extra


def _per_sequence_sdpa(query, key, value, lengths, scaling) -> torch.Tensor:
    """[B, H, L, D] causal attention within each sequence of `lengths` along L."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, sl], key[:, :, sl], value[:, :, sl],
                is_causal=True, scale=scaling, enable_gqa=True,
            )
        )
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_cu_seqlens: torch.Tensor | None = None,
    packed_max_seqlen: int | None = None,
    packed_lengths: tuple[int, ...] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, L, Hq, D]."""
    if attention_mask is not None or dropout:
        raise ValueError(f"{NAME} attention takes neither a mask nor dropout")
    batch, _, length, _ = query.shape
    lengths = packed_lengths or (length,)
    if sum(lengths) != length or (packed_lengths and batch != 1):
        raise ValueError(
            f"packed lengths {list(lengths)} do not tile a row of {length} tokens (batch {batch})"
        )
    varlen = _varlen_fn() if query.is_cuda and packed_lengths else None
    if varlen is None:
        return _per_sequence_sdpa(query, key, value, lengths, scaling).transpose(1, 2), None
    fn, extra = varlen
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [L, H, D]
    out = fn(q, k, v, packed_cu_seqlens, packed_cu_seqlens, packed_max_seqlen,
             packed_max_seqlen, scale=scaling, **extra)
    return out[None], None


def use_attention(model: torch.nn.Module, kind: Attention) -> None:
    """Switch an HF model's attention: "varlen" (this module) or "sdpa" (transformers')."""
    if kind not in choices(Attention):
        raise ValueError(f"attention must be one of {', '.join(choices(Attention))}, got {kind!r}")
    name = NAME if kind == "varlen" else "sdpa"
    if kind == "varlen":
        from transformers import AttentionInterface

        # A name with no mask function: transformers then builds no mask at all.
        AttentionInterface.register(NAME, varlen_attention_forward)
    model.set_attn_implementation(name)
