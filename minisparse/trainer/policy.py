"""The policy as the training passes run it, and its reference: loaded, its attention and
Liger kernels chosen, LoRA adapters added where model.lora asks, gradient checkpointing on
the layers the memory plan names.

The reference policy, for the loss's KL term, is a frozen copy kept on the CPU that visits
the GPU for its one log-prob pass a rollout (memory/phases.py's `visiting`); under LoRA it
is the base itself, the policy with its adapters off (models/lora.py), and no copy is made.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from minisparse.config.schema import Config
from minisparse.models.attention import use_attention
from minisparse.models.checkpointing import checkpoint_layers
from minisparse.models.liger import use_liger_kernel
from minisparse.models.loading import load_policy
from minisparse.models.lora import adapters_disabled, apply_lora
from minisparse.trainer.memory.choices import MemoryPlan
from minisparse.trainer.memory.phases import visiting
from minisparse.utils.distributed import rank


@dataclass
class Reference:
    """Where the reference log-probs come from: `module` on `device` for the pass (a copy
    that lives on the CPU), or, with `adapters_off`, the policy `module` with its LoRA
    adapters turned off."""

    module: torch.nn.Module
    device: torch.device
    adapters_off: bool = False

    def visit(self) -> AbstractContextManager[torch.nn.Module]:
        """The reference model, for a block that runs its forward passes."""
        if self.adapters_off:
            return adapters_disabled(self.module)
        return visiting(self.module, self.device)


def build_policy(cfg: Config, device: torch.device, plan: MemoryPlan,
                 reference: bool) -> tuple[torch.nn.Module, Any, Reference | None]:
    """(policy, tokenizer, reference or None): `reference`, the loss needs reference
    log-probs (the copy is made before DeepSpeed takes the policy, so it holds the
    starting weights)."""
    policy, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
    attention = use_attention(policy, cfg.model.attention)  # the reference copy inherits these
    kernels = use_liger_kernel(policy, cfg.model.liger_kernel, device.type == "cuda")
    if rank() == 0 and device.type == "cuda":  # GPU kernels: nothing to say on a CPU
        print(f"training passes: {attention}, {kernels}", flush=True)
    lora = cfg.model.lora.enabled
    if lora:  # only the adapters train; the reference is the base itself
        apply_lora(policy, cfg.model.lora, cfg.seed, cfg.model.path)
    if plan.gradient_checkpointing:
        checkpoint_layers(policy, plan.checkpointed_layers)
    if not reference:
        return policy, tokenizer, None
    if lora:
        return policy, tokenizer, Reference(policy, device, adapters_off=True)
    frozen = copy.deepcopy(policy).to("cpu").eval().requires_grad_(False)
    return policy, tokenizer, Reference(frozen, device)
