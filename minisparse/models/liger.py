"""Liger Kernel's fused RMSNorm, SwiGLU and RoPE for the training passes.

A plain HF decoder layer runs RMSNorm, RoPE and SiLU(gate) * up as chains of small
element-wise kernels, each a pass over the activations; on a GPU those passes cost
a log-prob pass and an update about a quarter of their time at the paper's shapes.
Liger Kernel (a maintained library, Triton) fuses each into one kernel and keeps the
weights as they are: the patched model still loads, saves and feeds the rollout engine
the same parameters. Liger's fused linear cross-entropy serves the no-grad log-prob
pass; the update keeps ours (grpo/fused_logprobs.py), which also gives the entropy.
"""
from __future__ import annotations

import importlib.util

from torch import nn

from minisparse.config.schema import ConfigError, Switch

FAMILIES = ("qwen2", "llama")


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def use_liger_kernel(model: nn.Module, mode: Switch, on_gpu: bool) -> str:
    """Patch model in place where mode and the machine allow; returns what the training
    passes run, for the start-up report. mode "on" without the library, a GPU or a
    supported family is a ConfigError naming the key."""
    family = getattr(model.config, "model_type", "")
    missing = [why for ok, why in (
        (liger_available(), "liger-kernel is not installed (pip install liger-kernel)"),
        (on_gpu, "the policy is not on a GPU"),
        (family in FAMILIES, f"model type {family!r} is not one of {', '.join(FAMILIES)}"),
    ) if not ok]
    if mode == "off" or (mode == "auto" and missing):
        reason = "off" if mode == "off" else missing[0]
        return f"PyTorch RMSNorm/SwiGLU/RoPE (model.liger_kernel={mode}: {reason})"
    if missing:
        raise ConfigError(f"model.liger_kernel=on but {missing[0]}")
    from liger_kernel.transformers import monkey_patch

    apply = getattr(monkey_patch, f"apply_liger_kernel_to_{family}")
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
          fused_linear_cross_entropy=False, model=model)
    model.liger_kernel = True  # grpo/logprobs.py: the no-grad log-prob head uses it too
    return "Liger Kernel RMSNorm/SwiGLU/RoPE"
