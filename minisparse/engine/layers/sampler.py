"""Token sampling with per-sequence, batch-independent randomness.

Randomness comes from a counter-based hash of (sequence seed, step, vocab id), turned into
Gumbel noise: sampling argmax(logits/T + gumbel) draws from softmax(logits/T). A sample's
tokens therefore depend only on its seed and its own logits, not on which other sequences
share the batch, on preemption, or on the device's RNG state; and the whole batch is one
vectorised op (no per-request torch.Generator loop, CUDA-graph friendly).

Log-probs are log_softmax(logits / T) in float32, taken BEFORE top-k/top-p truncation.
Temperature 0 is greedy; its log-prob is that of the argmax under the T=1 distribution.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding 32-bit values;
    multipliers stay below 2**31 so products never overflow int64."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def seed_for(base_seed: int, index: int) -> int:
    """The seed of sample `index` (prompt-major) of a call seeded with base_seed."""
    x = torch.tensor([base_seed & _MASK32], dtype=torch.int64)
    x = mix32(mix32(x) ^ (index & _MASK32))
    return int(x.item())


_column_hashes: dict[tuple[int, torch.device], torch.Tensor] = {}


def column_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """mix32 of each vocab id, computed once per (vocab, device)."""
    key = (vocab, device)
    if key not in _column_hashes:
        cols = torch.arange(vocab, device=device, dtype=torch.int64)
        _column_hashes[key] = mix32(cols + 0x61C8864)
    return _column_hashes[key]


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 noise [B, vocab], a pure function of (seed, step, column)."""
    row = mix32(mix32(seeds * 0x9E3779B + steps) ^ (steps * 0x2545F49))  # [B]
    bits = mix32(row[:, None] ^ column_hashes(vocab, seeds.device)[None, :])
    return unit_interval(bits)


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 strictly inside (0, 1). Only 23 bits are used: with 24,
    the top value (2**24 - 0.5) / 2**24 rounds to exactly 1.0 in float32, its Gumbel noise
    is +inf, and that column wins the argmax (or, added to a -inf truncated logit, gives
    NaN, which argmax also picks) about once per hundred steps at a 150k vocabulary."""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the top-p nucleus."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
        drop[:, 0] = False
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32; seeds/steps int64 [B]. Returns (tokens [B], logprobs [B])."""
    if temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(-1)
    else:
        scaled = logits / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        u = uniform_noise(seeds, steps, logits.shape[-1])
        gumbel = -torch.log(-torch.log(u))
        tokens = (truncate(scaled, top_k, top_p) + gumbel).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
