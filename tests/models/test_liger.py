"""Liger Kernel in the training passes: when it applies, and (on a GPU) that the patched
policy gives the same log-probs and gradients as the plain one."""
from __future__ import annotations

import copy

import pytest
import torch

from minisparse.config.schema import ConfigError
from minisparse.models import liger
from minisparse.models.loading import load_policy


@pytest.fixture
def tiny(tiny_path):
    return load_policy(str(tiny_path), "float32", torch.device("cpu"))[0]


def test_off_and_auto_on_cpu_leave_the_model_as_it_was(tiny):
    forward = tiny.model.norm.forward
    assert "model.liger_kernel=off" in liger.use_liger_kernel(tiny, "off", on_gpu=True)
    report = liger.use_liger_kernel(tiny, "auto", on_gpu=False)
    assert report.startswith("PyTorch") and "auto" in report
    assert tiny.model.norm.forward == forward


def test_on_names_what_is_missing(tiny, monkeypatch):
    monkeypatch.setattr(liger, "liger_available", lambda: False)
    with pytest.raises(ConfigError, match="model.liger_kernel=on but liger-kernel is not installed"):
        liger.use_liger_kernel(tiny, "on", on_gpu=True)
    monkeypatch.setattr(liger, "liger_available", lambda: True)
    with pytest.raises(ConfigError, match="not on a GPU"):
        liger.use_liger_kernel(tiny, "on", on_gpu=False)
    monkeypatch.setattr(tiny.config, "model_type", "gpt2")
    with pytest.raises(ConfigError, match="'gpt2' is not one of qwen2, llama"):
        liger.use_liger_kernel(tiny, "on", on_gpu=True)


@pytest.mark.skipif(not torch.cuda.is_available() or not liger.liger_available(),
                    reason="needs a GPU and liger-kernel")
@pytest.mark.parametrize("shape", ["qwen2.5-1.5b", "llama-3.2-1b"])
def test_patched_policy_matches_plain_on_gpu(shape):
    from minisparse.models.attention import use_attention
    from minisparse.trainer.logprobs import response_logprobs

    torch.manual_seed(0)
    plain = load_policy(shape, "bfloat16", torch.device("cuda"))[0]
    plain.model.layers = plain.model.layers[:4]
    use_attention(plain, "varlen")
    fused = copy.deepcopy(plain)
    assert liger.use_liger_kernel(fused, "on", on_gpu=True).startswith("Liger")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (30, 17)]
    responses = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (200, 311)]
    out = {}
    for name, model in (("plain", plain), ("fused", fused)):
        with torch.no_grad():  # the fused model's no-grad head is Liger's cross-entropy
            out[name + "_nograd"] = response_logprobs(model, prompts, responses, 311,
                                                      temperature=0.7, chunk=256)[0]
        logp, _ = response_logprobs(model, prompts, responses, 311, chunk=256)
        logp.sum().backward()
        grad = torch.cat([p.grad.float().flatten() for p in model.model.layers.parameters()])
        out[name] = (logp.detach().float(), grad)
    nograd = out["fused_nograd"].float()
    assert ((out["plain_nograd"].float() - nograd).norm() / nograd.norm()).item() < 2e-2
    for a, b in zip(out["plain"], out["fused"]):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    # grad-carrying RoPE of 131,072+ query rows (where Liger's dispatcher would pick its
    # CuTe DSL kernel, compiled per shape) runs Liger's Triton kernel
    import importlib
    family = "qwen2" if shape.startswith("qwen") else "llama"
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    q, k = (torch.randn(1, h, 8192, 128, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) * 1 for h in (16, 2))  # a projection's outputs
    cos, sin = torch.randn(2, 1, 8192, 128, device="cuda", dtype=torch.bfloat16)
    rotated, _ = hf.apply_rotary_pos_emb(q, k, cos, sin)
    assert type(rotated.grad_fn).__name__ == "LigerRopeFunctionBackward"
    # the patch stays with that model: a model built afterwards on the CPU still runs
    cpu = load_policy(shape, "float32", torch.device("cpu"))[0]
    assert "Liger" not in type(cpu.model.norm).__name__
    cpu.model.layers = cpu.model.layers[:1]
    cpu(torch.tensor([[1, 2, 3]]))


def test_training_rope_is_liger_triton_kernel_not_its_dispatcher(tiny, monkeypatch):
    """Liger's dispatcher sends large grad-carrying RoPE calls to a CuTe DSL kernel that
    compiles once per shape; every rollout brings new lengths, so the patch must call the
    Triton kernel itself. A stand-in liger_kernel records which one a CUDA call reaches."""
    import importlib
    import sys
    import types

    hf = importlib.import_module("transformers.models.qwen2.modeling_qwen2")
    calls = []
    # a plain RoPE (on a GPU an earlier test may have left Liger's patch in place); restored after
    monkeypatch.setattr(hf, "apply_rotary_pos_emb", lambda q, k, *a, **kw: calls.append("plain"))

    def apply_liger_kernel_to_qwen2(**kwargs):
        hf.apply_rotary_pos_emb = lambda q, k, *a, **kw: calls.append("dispatcher")

    class LigerRopeFunction:
        @staticmethod
        def apply(q, k, cos, sin, position_ids, unsqueeze_dim):
            calls.append(("triton", position_ids, unsqueeze_dim))

    modules = {"liger_kernel": types.ModuleType("liger_kernel"),
               "liger_kernel.transformers": types.ModuleType("liger_kernel.transformers"),
               "liger_kernel.transformers.monkey_patch": types.SimpleNamespace(
                   apply_liger_kernel_to_qwen2=apply_liger_kernel_to_qwen2),
               "liger_kernel.ops": types.ModuleType("liger_kernel.ops"),
               "liger_kernel.ops.rope": types.SimpleNamespace(LigerRopeFunction=LigerRopeFunction)}
    modules["liger_kernel.transformers"].monkey_patch = modules["liger_kernel.transformers.monkey_patch"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(liger, "liger_available", lambda: True)
    assert liger.use_liger_kernel(tiny, "on", on_gpu=True).startswith("Liger")
    on_cuda = types.SimpleNamespace(is_cuda=True)
    hf.apply_rotary_pos_emb(on_cuda, on_cuda, None, None, unsqueeze_dim=2)
    assert calls == [("triton", None, 2)]
