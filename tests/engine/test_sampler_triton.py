"""The fused Triton sampler against the PyTorch reference sampler (layers/sampler.py): the
same tokens from the same counter-hash noise, the same log-probs (of the truncated,
renormalised distribution when top-k / top-p truncate), greedy with
lowest-id ties. The kernel runs under Triton's interpreter (tiny shapes, several vocab
chunks per row so the merge is exercised); test_gpu_kernels.py runs it compiled on CUDA at
the real vocabulary (a separate module: the interpreter switch is process-wide)."""
from __future__ import annotations

import pytest
import torch

from minisparse.engine.layers.sampler import sample, truncate, uniform_noise
from triton_interpreter import import_interpreted

CASES = [(0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, -1, 1.0), (0.8, 20, 1.0), (1.0, -1, 0.6),
         (0.9, 40, 0.8)]


@pytest.fixture(scope="module")
def st():
    return import_interpreted("minisparse.engine.layers.sampler_triton")


def _inputs(B: int, V: int, seed: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
    seeds = torch.randint(0, 2**40, (B,), generator=g)
    steps = torch.randint(0, 10_000, (B,), generator=g)
    return logits.to(device), seeds.to(device), steps.to(device)


def _check(st, logits, seeds, steps, T, k, p, max_mismatch=0, **kw):
    """Tokens equal the reference race's (same noise) over the kernel's kept set: the
    reference's top-k / top-p set plus the tokens tied with its last one (common with bf16
    logits and top-p); with no ties that is sampler.sample itself."""
    tokens, lps = st.fused_sample(logits, T, k, p, seeds, steps, **kw)
    assert tokens.dtype == torch.int64 and lps.dtype == torch.float32
    scaled = logits.float() / (T if T not in (0, 1) else 1.0)
    ref_kept = truncate(scaled, k, p) > -float("inf")
    thresh = None if T == 0 else st.truncation_threshold(logits, T, k, p)
    kept = ref_kept if thresh is None else logits.float() >= thresh[:, None]
    assert bool((kept | ~ref_kept).all())
    if T == 0:
        ref_t = logits.float().argmax(-1)
    else:
        e = uniform_noise(seeds, steps, logits.shape[-1]).log_().neg_()
        prob = (scaled - scaled.amax(-1, keepdim=True)).exp().masked_fill(~kept, 0.0)
        ref_t = (prob / e).argmax(-1)
    if bool((kept == ref_kept).all()):
        assert torch.equal(ref_t, sample(logits.float(), T, k, p, seeds, steps)[0])
    assert int((tokens != ref_t).sum()) <= max_mismatch, (tokens, ref_t)
    # the log-prob is of the token it returned, under the T-scaled softmax renormalised
    # over the kernel's kept set (the whole row without truncation)
    want = torch.log_softmax(scaled.masked_fill(~kept, -float("inf")), -1)
    want = want.gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps, want, atol=2e-5, rtol=0)
    assert bool(kept.gather(-1, tokens[:, None]).all()), "a truncated token was sampled"
    return tokens


@pytest.mark.parametrize("T,k,p", CASES)
def test_matches_reference_over_several_chunks(st, T, k, p):
    logits, seeds, steps = _inputs(5, 2500, seed=int(T * 10) + k + int(p * 100))
    _check(st, logits, seeds, steps, T, k, p, chunk=512, block=128)


def test_bf16_logits_are_read_in_place(st):
    logits, seeds, steps = _inputs(4, 1000, seed=7, dtype=torch.bfloat16)
    _check(st, logits, seeds, steps, 1.0, -1, 1.0, chunk=256, block=64)
    _check(st, logits, seeds, steps, 0.0, -1, 1.0, chunk=256, block=64)


def test_greedy_ties_go_to_the_lowest_id_across_chunks(st):
    logits = torch.zeros(2, 600)
    logits[0, [300, 450]] = 5.0  # tie in two chunks (chunk 256)
    logits[1, [10, 11]] = 5.0  # tie inside one block
    seeds = steps = torch.zeros(2, dtype=torch.long)
    tokens, _ = st.fused_sample(logits, 0.0, -1, 1.0, seeds, steps, chunk=256, block=64)
    assert tokens.tolist() == [300, 10]


def test_noise_depends_on_seed_and_step_only(st):
    logits, seeds, steps = _inputs(3, 700, seed=3)
    a, _ = st.fused_sample(logits, 1.0, -1, 1.0, seeds, steps, chunk=256, block=64)
    b, _ = st.fused_sample(logits[[2, 0, 1]], 1.0, -1, 1.0, seeds[[2, 0, 1]], steps[[2, 0, 1]],
                           chunk=256, block=64)
    assert b.tolist() == a[[2, 0, 1]].tolist()
    c, _ = st.fused_sample(logits, 1.0, -1, 1.0, seeds, steps + 1, chunk=256, block=64)
    assert c.tolist() != a.tolist()


def test_threshold_keeps_the_reference_set(st):
    logits, _, _ = _inputs(6, 300, seed=11)
    for T, k, p in CASES[3:]:
        th = st.truncation_threshold(logits, T, k, p)
        kept = truncate(logits / T, k, p) > -float("inf")
        assert torch.equal(logits >= th[:, None], kept)
    assert st.truncation_threshold(logits, 1.0, -1, 1.0) is None


def test_bad_input_is_named(st):
    logits, seeds, steps = _inputs(2, 64, seed=0)
    with pytest.raises(ValueError, match="unit stride"):
        st.fused_sample(logits.t(), 1.0, -1, 1.0, seeds, steps)
    with pytest.raises(ValueError, match="seeds"):
        st.fused_sample(logits, 1.0, -1, 1.0, seeds[:1], steps)
    with pytest.raises(ValueError, match="block"):
        st.fused_sample(logits, 1.0, -1, 1.0, seeds, steps, chunk=100, block=64)
