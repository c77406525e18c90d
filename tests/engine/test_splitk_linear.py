"""The split-K projection kernel (layers/splitk_linear) and the partial-sum input of
fused_ops.add_rms_norm, under Triton's interpreter, against the PyTorch path they replace:
F.linear (after silu(gate) * up for the down projection), then residual add + RMSNorm."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisparse.engine.models import rms_norm
from triton_interpreter import import_interpreted


@pytest.fixture(scope="module")
def mods():
    return (import_interpreted("minisparse.engine.layers.splitk_linear"),
            import_interpreted("minisparse.engine.layers.fused_ops"))


class _Norm(torch.nn.Module):
    def __init__(self, w: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = w, eps


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("M,K,splits", [(5, 96, 3), (16, 64, 1), (20, 100, 2)])
def test_parts_sum_to_the_product(mods, silu, M, K, splits):
    """Each slice covers its own K range (uneven last slice, masked rows and K tail)."""
    sk, _ = mods
    g = torch.Generator().manual_seed(M + K)
    N = 48
    a = torch.randn(M, 2 * K if silu else K, generator=g)
    w = torch.randn(N, K, generator=g)
    plan = sk.SplitPlan(block_m=16, block_n=32, block_k=16, splits=splits)
    parts = sk.linear_parts(a, w, plan, silu_mul=silu)
    assert parts.dtype == torch.float32 and parts.shape == (splits, M, N)
    x = F.silu(a[:, :K]) * a[:, K:] if silu else a
    torch.testing.assert_close(parts.sum(0), x @ w.T, atol=1e-4, rtol=1e-5)
    k_per = ((K + splits - 1) // splits + 15) // 16 * 16
    torch.testing.assert_close(parts[0], x[:, :k_per] @ w[:, :k_per].T, atol=1e-4, rtol=1e-5)


def test_rejects_mismatched_operands(mods):
    sk, _ = mods
    plan = sk.SplitPlan(16, 32, 16, 2)
    with pytest.raises(ValueError, match="silu_mul=True"):
        sk.linear_parts(torch.zeros(4, 64), torch.zeros(8, 64), plan, silu_mul=True)
    with pytest.raises(ValueError, match="K-contiguous"):
        sk.linear_parts(torch.zeros(64, 4).T, torch.zeros(8, 64), plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_add_rms_norm_reduces_partials(mods, dtype, with_bias):
    """h = residual + round(sum of slices + bias): the projection's output as F.linear
    rounds it, then the same add + RMSNorm as for a model-dtype input."""
    _, ops = mods
    g = torch.Generator().manual_seed(7)
    T, N = 6, 80
    parts = torch.randn(3, T, N, generator=g)
    res = torch.randn(T, N, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    out, h = ops.add_rms_norm(parts, res, w, 1e-6, bias=bias)
    proj = parts.sum(0) + (bias.float() if with_bias else 0)
    want_h = res + proj.to(dtype)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, want_h, **tol)
    torch.testing.assert_close(out, rms_norm(want_h, _Norm(w, 1e-6)), **tol)
    assert out.dtype == dtype and h.dtype == dtype


def test_bias_needs_partials(mods):
    _, ops = mods
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="bias"):
        ops.add_rms_norm(x, x, torch.ones(8), 1e-6, bias=torch.zeros(8))
