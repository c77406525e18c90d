"""Model FLOPs of the training passes, and MFU against a peak rate.

MFU is the model's own arithmetic over (time x peak): work that a faster implementation
would skip or redo (padding, gradient-checkpointing recomputation, the fused LM head's
recomputed logits in the backward) is not counted. Per token of a packed row:

* matmuls: 2 FLOPs per weight of every linear layer of the decoder (embedding lookups
  are not matmuls), and 2·V·H for the LM head, which only response positions go through;
* attention: per layer, head and causal (query, key) pair, 2·D for Q·Kᵀ and 2·D for P·V,
  with L(L+1)/2 pairs in a sequence of L tokens;
* the update runs forward + backward: 3x the forward (backward = 2x forward).

The usual shorthand 6·N·T counts every parameter over every token; the count here
differs from it by the embedding table and by prompt tokens skipping the LM head (~1%
on Qwen2.5-3B with 1,000-token responses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minisparse.models.loading import attention_heads

# Dense bf16 tensor-core peak per GPU, TFLOP/s, from the vendors' datasheets (SXM parts,
# without sparsity). MFU is quoted against these unless log.peak_tflops says otherwise;
# the lent H200 reached ~790 TFLOP/s on large bf16 GEMMs (docs/benchmarks.md).
PEAK_TFLOPS = (
    ("H200", 989.4),
    ("H100", 989.4),
    ("H800", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
)


@dataclass(frozen=True)
class FlopShape:
    body_params: int  # weights of the decoder's linear layers (LM head excluded)
    head_params: int  # V·H
    layers: int
    q_heads: int
    head_dim: int


def flop_shape(model: nn.Module) -> FlopShape:
    """The counts of an HF causal LM (Qwen2 / Llama layout: .model.layers, .lm_head)."""
    body = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, nn.Linear)
    )
    heads, _, head_dim = attention_heads(model.config)
    return FlopShape(
        body_params=body,
        head_params=model.lm_head.weight.numel(),
        layers=model.config.num_hidden_layers,
        q_heads=heads,
        head_dim=head_dim,
    )


def forward_flops(shape: FlopShape, seq_lens: list[int], head_tokens: int) -> float:
    """FLOPs of one forward over sequences of seq_lens tokens (each attending causally
    within itself), head_tokens of which go through the LM head."""
    pairs = sum(n * (n + 1) // 2 for n in seq_lens)
    attention = 4 * shape.layers * shape.q_heads * shape.head_dim * pairs
    return 2.0 * shape.body_params * sum(seq_lens) + 2.0 * shape.head_params * head_tokens + attention


def batch_forward_flops(shape: FlopShape, prompts: list[list[int]], responses: list[list[int]]) -> float:
    """forward_flops of a rollout batch: prompt + response per sample, the LM head over
    the response tokens (what logprobs.py computes)."""
    lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    return forward_flops(shape, lens, sum(len(r) for r in responses))


def peak_flops(configured_tflops: float, device: torch.device) -> float | None:
    """Peak FLOP/s: the configured value when > 0, else the datasheet value of the GPU's
    name; None when neither applies (CPU, an unlisted GPU): then no MFU is logged."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def mfu_metrics(name: str, flops: float, seconds: float, peak: float | None) -> dict[str, float]:
    """perf/{name}_tflops (achieved, per GPU) and perf/{name}_mfu (when the peak is known)."""
    out = {f"perf/{name}_tflops": flops / seconds / 1e12 if seconds > 0 else 0.0}
    if peak:
        out[f"perf/{name}_mfu"] = flops / seconds / peak if seconds > 0 else 0.0
    return out
