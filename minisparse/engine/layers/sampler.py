"""Token sampling with per-sequence, batch-independent randomness.

Randomness comes from a counter-based hash of (sequence seed, step, vocab id): one uniform
u in (0, 1) per (row, column), used in an exponential race: with E = -log(u) ~ Exp(1),
argmax(p / E) is distributed as p (the same draw as the Gumbel trick argmax(logits/T +
-log(-log u)), with one log instead of two). A sample's tokens therefore depend only on
its seed and its own logits, not on which other sequences share the batch, on preemption,
or on the device's RNG state; and the whole batch is one vectorised op (no per-request
torch.Generator loop, no host sync, CUDA-graph friendly).

The [B, vocab] hash is int32 arithmetic (multiplication wraps modulo 2**32 on CPU and
CUDA): the row hash (seed, step) xor a cached per-column hash, then one murmur3 fmix32.

Log-probs are those of the distribution the token was drawn from: log_softmax(logits / T)
in float32, renormalised over the tokens top-k/top-p keep when truncation is on (computed
as scaled[token] - logsumexp(scaled over the kept tokens), not as a full log_softmax). The
trainer divides the dense policy's probability by this one (the Sparse-RL importance
weights, the mismatch metrics), so it must be the sampler's own law: with truncation the
untruncated log-prob would claim the sampler could have drawn tokens it never can.
Temperature 0 is greedy; its log-prob is that of the argmax under the T=1 distribution.

This is the reference and the CPU path; on CUDA the same draw runs as one Triton pass
(sampler_triton, which reads this module's column hashes and truncation rule).
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding 32-bit values;
    multipliers stay below 2**31 so products never overflow int64. Used for seeds only."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def seed_for(base_seed: int, index: int) -> int:
    """The seed of sample `index` (prompt-major) of a call seeded with base_seed."""
    x = torch.tensor([base_seed & _MASK32], dtype=torch.int64)
    x = mix32(mix32(x) ^ (index & _MASK32))
    return int(x.item())


def _i32(c: int) -> int:
    """A 32-bit constant as the signed int32 with the same bits."""
    c &= _MASK32
    return c - (1 << 32) if c >= 1 << 31 else c


_C1, _C2 = _i32(0x85EBCA6B), _i32(0xC2B2AE35)  # murmur3 fmix32 multipliers
_GOLDEN, _STEP_MUL = _i32(0x9E3779B9), _i32(0x2545F491)


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's >> on int32 is arithmetic)."""
    return (x >> n) & ((1 << (32 - n)) - 1)


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int32 tensors (wrapping multiplies): a bijection of
    32-bit values with full avalanche. Returns a new tensor; x is not modified."""
    x = x ^ _srl(x, 16)
    x *= _C1
    x ^= _srl(x, 13)
    x *= _C2
    x ^= _srl(x, 16)
    return x


def to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values (any range; their low 32 bits are used) -> int32 with the same bits."""
    if x.dtype == torch.int32:
        return x
    x = x.long() & _MASK32
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


_column_hashes: dict[tuple[int, torch.device], torch.Tensor] = {}


def column_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """int32 hash of each vocab id, computed once per (vocab, device)."""
    key = (vocab, torch.device(device))
    if key not in _column_hashes:
        cols = torch.arange(vocab, device=device, dtype=torch.int32)
        _column_hashes[key] = fmix32(fmix32(cols ^ 0x61C8864) + _GOLDEN)
    return _column_hashes[key]


def row_hashes(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """int32 hash [B] of each (seed, step) pair."""
    return fmix32(fmix32(to_int32(seeds)) ^ (to_int32(steps) * _STEP_MUL + _GOLDEN))


def random_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 hashes [B, vocab], a pure function of (seed, step, column)."""
    return fmix32(row_hashes(seeds, steps)[:, None] ^ column_hashes(vocab, seeds.device)[None, :])


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 noise [B, vocab], a pure function of (seed, step, column)."""
    return unit_interval(random_bits(seeds, steps, vocab))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int32, or int64 holding 0..2**32-1) -> float32 strictly inside (0, 1),
    from the top 23 bits. Not 24: the top value (2**24 - 0.5) / 2**24 rounds to exactly 1.0
    in float32, its noise is infinite, and that column wins the argmax (or, with a -inf
    truncated logit, gives NaN, which argmax also picks) about once per hundred steps at a
    150k vocabulary."""
    u = _srl(bits, 9).float()
    return u.add_(0.5).mul_(1.0 / (1 << 23))


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
    """logits [B, V] float32; seeds/steps integer [B] (int64 or int32; the low 32 bits are
    used). Returns (tokens [B] int64, logprobs [B] float32). No host sync."""
    scaled = logits if temperature in (0, 1) else logits / temperature
    m = scaled.amax(-1, keepdim=True)
    shifted = scaled - m  # <= 0, max 0
    p = shifted.exp()  # unnormalised probabilities, max 1
    lse = p.sum(-1).log()  # logsumexp(scaled) - m
    if temperature == 0:
        tokens = logits.argmax(-1)
    else:
        if 0 < top_k < logits.shape[-1] or top_p < 1.0:
            p = (truncate(scaled, top_k, top_p) - m).exp_()  # truncated tokens get p = 0
            lse = p.sum(-1).log()  # renormalised over the kept tokens
        e = uniform_noise(seeds, steps, logits.shape[-1]).log_().neg_()  # Exp(1) > 0
        tokens = p.div_(e).argmax(-1)
    logprobs = shifted.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return tokens, logprobs

