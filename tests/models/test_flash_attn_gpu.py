"""flash-attn-4 against torch's varlen kernel, on a Hopper or Blackwell GPU with
flash-attn-4 installed (skipped elsewhere): the same packed attention, forward and
backward, and the same log-probs and gradients through an HF model."""
import pytest
import torch
from policy_models import tiny_qwen2

from minisparse.models import attention
from minisparse.models.attention import (
    FLASH_NAME,
    NAME,
    flash_attention_forward,
    packing_kwargs,
    use_attention,
    varlen_attention_forward,
)
from minisparse.trainer.logprobs import response_logprobs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not attention._flash_installed(), reason="needs flash-attn-4"),
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or torch.cuda.get_device_capability()[0] not in attention.FLASH_GPUS,
        reason="flash-attn-4 runs on Hopper or Blackwell"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _attend(forward, lengths, seed=7):
    """Output and q/k/v gradients of one packed bf16 attention at the 3B shape (16 query
    heads, 2 KV heads, head dim 128)."""
    g = torch.Generator("cuda").manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(1, h, n, 128, generator=g, device="cuda", dtype=torch.bfloat16)
               .requires_grad_() for h in (16, 2, 2))
    out, _ = forward(None, q, k, v, None, scaling=128**-0.5,
                     **packing_kwargs(lengths, q.device))
    grad_out = torch.randn(out.shape, generator=g, device="cuda", dtype=out.dtype)
    out.backward(grad_out)
    return [out, q.grad, k.grad, v.grad]


def test_flash_attn_matches_torch_varlen_forward_and_backward():
    assert attention._varlen_fn() is not None, "torch's varlen kernel is the reference here"
    lengths = [300, 17, 1024, 5, 700, 2000, 129]
    flash = _attend(flash_attention_forward, lengths)
    torch_ = _attend(varlen_attention_forward, lengths)
    for name, a, b in zip(("out", "dq", "dk", "dv"), flash, torch_):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))  # ~1e-3 measured in bf16


def test_flash_attn_is_chosen_and_model_logprobs_match_torch_varlen():
    model = tiny_qwen2(vocab=97, hidden=256, layers=2, heads=2, kv_heads=1,
                       max_positions=1024).to("cuda", torch.bfloat16)  # head dim 128
    prompts = [[1 + i % 90 for i in range(n)] for n in (40, 3, 200)]
    responses = [[2 + i % 80 for i in range(n)] for n in (300, 64, 17)]
    results = {}
    for kind, name in (("auto", FLASH_NAME), ("varlen", NAME)):
        words = use_attention(model, kind)
        assert model.config._attn_implementation == name, words
        model.zero_grad()
        logp, _ = response_logprobs(model, prompts, responses, width=300, chunk=64)
        logp.sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()
                           if p.grad is not None])
        results[kind] = (logp.detach(), grads)
    assert _rel(results["auto"][0], results["varlen"][0]) < 1e-2
    assert _rel(results["auto"][1], results["varlen"][1]) < 3e-2
