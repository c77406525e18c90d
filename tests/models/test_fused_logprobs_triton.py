"""The fused LM head's Triton kernels (models/fused_logprobs_triton.py) under Triton's CPU
interpreter, against float64 autograd: row statistics, the in-place logits gradient, and
the whole chunked head (ChunkedLogprobs) with the kernels in place of the PyTorch ops.
Vocabularies span several of the kernels' column blocks, the last one partial.
tests/models/test_gpu_fused_logprobs.py runs them compiled at Qwen's vocabulary."""
from __future__ import annotations

import pytest
import torch

from minisparse.models.fused_logprobs import ChunkedLogprobs
from triton_interpreter import import_interpreted

# NumPy warns where the kernels compute -inf - -inf on masked lanes that tl.where drops
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(scope="module")
def kernels():
    return import_interpreted("minisparse.models.fused_logprobs_triton")


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(lse, logp, entropy) in float64 with autograd, of softmax(logits / T)."""
    z = logits.double() / temperature
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets[:, None])[:, 0] - lse
    ent = lse - (torch.softmax(z, -1) * z).sum(-1)
    return lse, logp, ent


def _logits(rows: int, vocab: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return logits.to(device), targets.to(device)


def check_stats(kernels, rows, vocab, temperature, dtype, device="cpu"):
    logits, targets = _logits(rows, vocab, seed=rows + vocab, dtype=dtype, device=device)
    lse, logp, ent = kernels.row_stats(logits, targets, temperature, with_entropy=True)
    want = reference(logits, targets, temperature)
    for got, ref in zip((lse, logp, ent), want):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-4)
    _, logp_only, none = kernels.row_stats(logits, targets, temperature, with_entropy=False)
    assert none is None
    torch.testing.assert_close(logp_only, logp, rtol=0, atol=0)


def check_grad(kernels, rows, vocab, temperature, dtype, with_logp, with_ent, device="cpu"):
    logits, targets = _logits(rows, vocab, seed=7 * rows + vocab, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(vocab)
    g_logp = torch.randn(rows, generator=g).to(device) if with_logp else None
    g_ent = torch.randn(rows, generator=g).to(device) if with_ent else None
    z = logits.double().requires_grad_()
    lse, logp, ent = reference(z, targets, temperature)
    total = sum((t * c.double()).sum() for t, c in ((logp, g_logp), (ent, g_ent)) if c is not None)
    (want,) = torch.autograd.grad(total, z)
    got = kernels.row_grad_(logits, targets, lse.detach().float(), ent.detach().float(),
                            g_logp, g_ent, temperature)
    assert got is logits  # in place
    scale = want.abs().max().item()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [37, 5000])
def test_row_stats(kernels, vocab, temperature):
    check_stats(kernels, 5, vocab, temperature, torch.float32)


def test_row_stats_bfloat16_logits(kernels):
    check_stats(kernels, 3, 4100, 0.7, torch.bfloat16)


@pytest.mark.parametrize("with_logp,with_ent", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_row_grad(kernels, temperature, with_logp, with_ent):
    check_grad(kernels, 4, 4500, temperature, torch.float32, with_logp, with_ent)


def test_row_grad_bfloat16_in_place(kernels):
    check_grad(kernels, 3, 2100, 1.0, torch.bfloat16, True, True)


def test_shapes_are_checked(kernels):
    logits, targets = _logits(4, 50, seed=0)
    with pytest.raises(ValueError, match="unit column stride"):
        kernels.row_stats(logits.t(), targets, 1.0, False)
    with pytest.raises(ValueError, match="targets"):
        kernels.row_stats(logits, targets[:3], 1.0, False)
    with pytest.raises(ValueError, match="entropy"):
        kernels.row_grad_(logits, targets, targets.float(), None, None, targets.float(), 1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_chunked_head_with_kernels_equals_unfused(kernels, temperature):
    """The whole head: chunks of 4 over 11 rows (the last one short), logits GEMM into one
    reused buffer, kernels for the softmax work, float32 weight gradient summed over chunks."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, 16, generator=g).requires_grad_()
    weight = torch.randn(2500, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 2500, (11,), generator=g)
    c_logp, c_ent = torch.randn(11, generator=g), torch.randn(11, generator=g)

    _, logp, ent = reference(hidden.double() @ weight.double().t(), targets, temperature)
    (logp * c_logp.double() + ent * c_ent.double()).sum().backward()
    want = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    logp, ent = ChunkedLogprobs.apply(hidden, weight, targets, temperature, 4, True, kernels)
    (logp * c_logp + ent * c_ent).sum().backward()
    for got, ref in zip((logp, ent, hidden.grad, weight.grad), want):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-4, atol=1e-4)
