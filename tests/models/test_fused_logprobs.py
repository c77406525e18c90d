import pytest
import torch

from minisparse.models.fused_logprobs import fused_logprobs
from minisparse.trainer.logprobs import token_logprobs


def _inputs(t=13, h=16, v=37, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, targets


def _unfused(hidden, weight, targets, temperature):
    logits = hidden @ weight.t() / temperature
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, ent


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_gradients_equal_unfused(chunk, temperature):
    hidden, weight, targets = _inputs(seed=chunk)
    g = torch.Generator().manual_seed(1)
    coef_logp = torch.randn(13, generator=g, dtype=torch.float64)
    coef_ent = torch.randn(13, generator=g, dtype=torch.float64)

    logp, ent = _unfused(hidden, weight, targets, temperature)
    (logp * coef_logp + ent * coef_ent).sum().backward()
    ref = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    logp, ent = fused_logprobs(hidden, weight, targets, temperature, chunk, with_entropy=True)
    (logp * coef_logp + ent * coef_ent).sum().backward()
    torch.testing.assert_close(logp, ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, ref[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hidden.grad, ref[2], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weight.grad, ref[3], rtol=1e-10, atol=1e-10)


def test_logprob_only_gradient_equals_token_logprobs():
    """The update's usual case: no entropy in the loss, float32 like a real run."""
    hidden, weight, targets = _inputs(t=21, h=8, v=50, seed=3, dtype=torch.float32)
    logp_ref, _ = token_logprobs(hidden @ weight.t(), targets, with_entropy=False)
    logp_ref.square().sum().backward()
    ref = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    logp, ent = fused_logprobs(hidden, weight, targets, chunk=5)
    assert ent is None
    logp.square().sum().backward()
    torch.testing.assert_close(logp, logp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, ref[1], rtol=1e-5, atol=1e-5)


def test_bfloat16_matches_unfused_bfloat16_path():
    """bf16 weights: logits rounded to bf16 before the float32 softmax in both paths."""
    hidden, weight, targets = _inputs(t=9, h=32, v=64, seed=5, dtype=torch.bfloat16)
    logp_ref, _ = token_logprobs(hidden @ weight.t(), targets, with_entropy=False)
    logp, _ = fused_logprobs(hidden, weight, targets, chunk=4)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-5)


def test_bad_shapes_and_chunk_are_named():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="chunk"):
        fused_logprobs(hidden, weight, targets, chunk=0)
    with pytest.raises(ValueError, match=r"hidden \[T, H\]"):
        fused_logprobs(hidden, weight[:, :3], targets)
