"""The fused LM head's Triton kernels compiled on CUDA (skipped without it), at Qwen's
151,936-word vocabulary in bf16, against float64 references; and the whole head on CUDA
(kernels) against its PyTorch path. Kept apart from the interpreter tests, which switch
Triton to its interpreter for the whole process: run this module in its own pytest process."""
from __future__ import annotations

import pytest
import torch

import test_fused_logprobs_triton as cpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VOCAB = 151_936


@pytest.fixture(scope="module")
def kernels():
    from minisparse.models import fused_logprobs_triton
    return fused_logprobs_triton


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_stats_full_vocab(kernels, temperature):
    cpu.check_stats(kernels, 64, VOCAB, temperature, torch.bfloat16, device="cuda")


@pytest.mark.parametrize("with_logp,with_ent", [(True, False), (True, True)])
def test_row_grad_full_vocab(kernels, with_logp, with_ent):
    cpu.check_grad(kernels, 32, VOCAB, 0.7, torch.bfloat16, with_logp, with_ent, device="cuda")


def test_head_kernels_match_pytorch_path():
    """fused_logprobs on CUDA (kernels, float32 weight-gradient GEMM) against the same
    call with the PyTorch ops, bf16 like a real run: 3,000 tokens in chunks of 1,024."""
    from minisparse.models import fused_logprobs as fl

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(3000, 2048, device="cuda", generator=g) * 0.5).bfloat16()
    weight = (torch.randn(VOCAB, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    targets = torch.randint(0, VOCAB, (3000,), device="cuda", generator=g)
    coef = torch.randn(3000, device="cuda", generator=g)
    outs = {}
    for name, module in (("kernels", fl.KERNELS), ("torch", None)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        saved, fl.KERNELS = fl.KERNELS, module
        try:
            logp, ent = fl.fused_logprobs(h, w, targets, 0.7, 1024, with_entropy=True)
            (logp * coef + ent * coef.flip(0)).sum().backward()
        finally:
            fl.KERNELS = saved
        outs[name] = [logp.detach(), ent.detach(), h.grad.float(), w.grad.float()]
    for got, ref in zip(outs["kernels"], outs["torch"]):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
