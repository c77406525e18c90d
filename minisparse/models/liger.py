"""Liger Kernel's fused RMSNorm, SwiGLU and RoPE for the training passes.

A plain HF decoder layer runs RMSNorm, RoPE and SiLU(gate) * up as chains of small
element-wise kernels, each a pass over the activations; on a GPU those passes cost
a log-prob pass and an update about a quarter of their time at the paper's shapes.
Liger Kernel (a maintained library, Triton) fuses each into one kernel and keeps the
weights as they are: the patched model still loads, saves and feeds the rollout engine
the same parameters. The LM head is ours (models/fused_logprobs.py), which gives the
entropy too and measured faster than Liger's fused linear cross-entropy on the no-grad
log-prob pass (docs/benchmarks.md).
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from minisparse.config.schema import ConfigError, Switch

FAMILIES = ("qwen2", "llama")


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _missing(family: str, on_gpu: bool) -> list[str]:
    """Why Liger's kernels cannot run here (empty: they can)."""
    return [why for ok, why in (
        (liger_available(), "liger-kernel is not installed (pip install liger-kernel)"),
        (on_gpu, "the policy is not on a GPU"),
        (family in FAMILIES, f"model type {family!r} is not one of {', '.join(FAMILIES)}"),
    ) if not ok]


def liger_applies(mode: Switch, family: str, on_gpu: bool) -> bool:
    """Whether use_liger_kernel will patch a model of this family (the memory plan counts
    the training passes' activations before the model loads)."""
    return mode != "off" and not _missing(family, on_gpu)


def use_liger_kernel(model: nn.Module, mode: Switch, on_gpu: bool) -> str:
    """Patch model in place where mode and the machine allow; returns what the training
    passes run, for the start-up report. mode "on" without the library, a GPU or a
    supported family is a ConfigError naming the key."""
    family = getattr(model.config, "model_type", "")
    missing = _missing(family, on_gpu)
    if mode == "off" or (mode == "auto" and missing):
        reason = "off" if mode == "off" else missing[0]
        return f"PyTorch RMSNorm/SwiGLU/RoPE (model.liger_kernel={mode}: {reason})"
    if missing:
        raise ConfigError(f"model.liger_kernel=on but {missing[0]}")
    _patch_instance(model, family)
    return "Liger Kernel RMSNorm/SwiGLU/RoPE"


def _patch_instance(model: nn.Module, family: str) -> None:
    """Liger's patch for one model. It also swaps transformers' module-level RMSNorm and MLP
    classes and RoPE function, which would reach every model of the process, CPU ones
    included (a CPU tensor in a Triton kernel fails): the classes go back once the
    instance is patched, and RoPE takes Liger's kernel for CUDA tensors only."""
    from liger_kernel.transformers import monkey_patch

    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = "Qwen2" if family == "qwen2" else "Llama"
    names = ("apply_rotary_pos_emb", f"{prefix}RMSNorm", f"{prefix}MLP")
    saved = {name: getattr(hf, name) for name in names}
    getattr(monkey_patch, f"apply_liger_kernel_to_{family}")(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
        fused_linear_cross_entropy=False, model=model)
    patched_rope = hf.apply_rotary_pos_emb is not saved["apply_rotary_pos_emb"]
    for name, value in saved.items():
        setattr(hf, name, value)
    if patched_rope:
        hf.apply_rotary_pos_emb = _rope_on_cuda(_triton_rope(), saved["apply_rotary_pos_emb"])


def _triton_rope() -> Callable:
    """Liger's Triton RoPE, always. Liger's dispatcher sends large grad-carrying calls to a
    CuTe DSL kernel that compiles once per shape: every rollout brings new micro-batch
    lengths, and those compiles took 14.7 s of a ~22 s update at the coder shape."""
    from liger_kernel.ops.rope import LigerRopeFunction

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1):
        return LigerRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)

    return rope


def _rope_on_cuda(liger_rope: Callable, plain_rope: Callable) -> Callable:
    if getattr(plain_rope, "liger_dispatch", False):  # already patched once
        return plain_rope

    def rope(q: torch.Tensor, k: torch.Tensor, *args, **kwargs):
        return (liger_rope if q.is_cuda else plain_rope)(q, k, *args, **kwargs)

    rope.liger_dispatch = True
    return rope
