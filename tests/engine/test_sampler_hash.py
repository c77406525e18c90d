"""The sampler's int32 counter hash: exact wraparound arithmetic (against a pure-Python
murmur3 finalizer), statistical quality of the noise (uniformity, no correlation between
neighbouring columns, steps or seeds), the exponential race against the Gumbel trick on
the same noise, and (on CUDA) bit-identical noise and tokens on the GPU."""
from __future__ import annotations

import pytest
import torch

from minisparse.engine.layers.sampler import (
    fmix32,
    random_bits,
    row_hashes,
    sample,
    to_int32,
    truncate,
    uniform_noise,
)


def _fmix32_ref(h: int) -> int:
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_fmix32_wraps_like_uint32():
    g = torch.Generator().manual_seed(0)
    vals = torch.randint(-2**31, 2**31 - 1, (5000,), generator=g, dtype=torch.int64).tolist()
    vals += [0, 1, -1, 2**31 - 1, -2**31]
    x = torch.tensor(vals, dtype=torch.int32)
    got = [v & 0xFFFFFFFF for v in fmix32(x).tolist()]
    assert got == [_fmix32_ref(v) for v in vals]
    assert fmix32(x).dtype == torch.int32 and torch.equal(x, torch.tensor(vals, dtype=torch.int32))


def test_to_int32_keeps_low_bits():
    x = torch.tensor([0, 1, 2**31, 2**32 - 1, 2**32 + 5, -3], dtype=torch.int64)
    assert [v & 0xFFFFFFFF for v in to_int32(x).tolist()] == [v & 0xFFFFFFFF for v in x.tolist()]


def test_noise_is_uniform_and_uncorrelated():
    B, V = 256, 4096
    seeds = torch.arange(B, dtype=torch.int64) * 2654435761 % 2**32
    steps = torch.full((B,), 3, dtype=torch.int64)
    u = uniform_noise(seeds, steps, V)
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    n = u.numel()
    counts = torch.bincount((u * 64).long().flatten(), minlength=64).double()
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    assert chi2 < 130  # 63 degrees of freedom: mean 63, sd ~11
    bits = random_bits(seeds, steps, V)
    for b in range(32):  # every bit fair
        assert abs(((bits >> b) & 1).double().mean().item() - 0.5) < 0.003

    def corr(a, b):
        a, b = a.flatten().double() - 0.5, b.flatten().double() - 0.5
        return ((a * b).mean() / (a.std() * b.std())).item()

    next_step = uniform_noise(seeds, steps + 1, V)
    next_seed = uniform_noise(seeds + 1, steps, V)
    for other in (u[:, 1:], next_step, next_seed):  # neighbouring column, step, seed
        mine = u[:, :-1] if other.shape[1] == V - 1 else u
        assert abs(corr(mine, other)) < 0.005  # sd of the estimate ~ 1 / sqrt(1M) = 0.001
    assert torch.unique(row_hashes(seeds[:1].repeat(10000), torch.arange(10000))).numel() == 10000


def test_exponential_race_equals_gumbel_on_the_same_noise():
    torch.manual_seed(1)
    B, V = 512, 1000
    logits = torch.randn(B, V) * 3
    seeds, steps = torch.arange(B) * 31 + 7, torch.arange(B) % 5
    u = uniform_noise(seeds, steps, V)
    gumbel = -torch.log(-torch.log(u))
    for T, k, p in ((1.0, -1, 1.0), (0.7, 40, 1.0), (1.3, -1, 0.8)):
        tokens, lps = sample(logits, T, k, p, seeds, steps)
        ref = (truncate(logits / T, k, p) + gumbel).argmax(-1)
        assert (tokens == ref).float().mean().item() > 0.998
        law = torch.log_softmax(truncate(logits / T, k, p), -1)  # the truncated law
        torch.testing.assert_close(lps, law.gather(-1, tokens[:, None])[:, 0])


def test_greedy_logprob_is_the_t1_logprob_of_the_argmax():
    torch.manual_seed(2)
    logits = torch.randn(8, 300)
    tokens, lps = sample(logits, 0, -1, 1.0, torch.arange(8), torch.zeros(8, dtype=torch.long))
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_noise_and_tokens_match_cpu():
    torch.manual_seed(3)
    B, V = 64, 151936
    logits = torch.randn(B, V)
    seeds = torch.arange(B, dtype=torch.int64) * 7919 + 2**31
    steps = torch.arange(B, dtype=torch.int64) * 3
    assert torch.equal(random_bits(seeds, steps, V),
                       random_bits(seeds.cuda(), steps.cuda(), V).cpu())
    for T, k, p in ((1.0, -1, 1.0), (0.6, 50, 0.9)):
        cpu = sample(logits, T, k, p, seeds, steps)
        gpu = sample(logits.cuda(), T, k, p, seeds.cuda(), steps.cuda())
        assert (cpu[0] == gpu[0].cpu()).float().mean().item() > 0.99
        torch.testing.assert_close(cpu[1], gpu[1].cpu(), atol=1e-4, rtol=0)
