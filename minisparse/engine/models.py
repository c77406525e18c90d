"""The forward pass of an HF Qwen2/Llama *ForCausalLM, computed over the module's own
parameter tensors (no copy of the weights) with the engine's paged KV cache.

Weights are read from the modules at call time, so a ZeRO-2 policy whose parameters are
updated in place is always current, and update_weights() only has to re-bind the module.
RoPE uses the model's own rotary_emb (inv_freq and attention_scaling, as built by
transformers' ROPE_INIT_FUNCTIONS for the checkpoint's rope settings: default, llama3,
yarn, ...); dynamic (input-length dependent) rope types are not supported.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisparse.engine.layers.attention import AttnContext, paged_attention


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """Same arithmetic as Qwen2RMSNorm / LlamaRMSNorm (float32 statistics)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CausalLM:
    """Forward over a bound HF causal LM. Supports GQA, qkv/mlp biases, tied embeddings."""

    def __init__(self, model: nn.Module) -> None:
        self.bind(model)
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.q_proj.weight.shape[0] // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.max_position = getattr(cfg, "max_position_embeddings", 1 << 20)
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
            raise NotImplementedError("sliding-window attention is not supported by the engine")

    def bind(self, model: nn.Module) -> None:
        """(Re-)attach to a model's modules; nothing is copied."""
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers)
        rotary = self.base.rotary_emb
        if getattr(rotary, "rope_type", "default") == "dynamic":
            raise NotImplementedError("dynamic rope scaling is not supported by the engine")
        self.inv_freq = rotary.inv_freq.float()
        self.attention_scaling = float(rotary.attention_scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    def rope(self, positions: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None, :]
        return cos, sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                q_ring: torch.Tensor | None) -> torch.Tensor:
        """input_ids/positions [N] (packed) -> final hidden states [N, hidden].
        k_cache/v_cache [layers, slots, H_kv, D]; q_ring [layers, rows, H_q, D] or None."""
        h = F.embedding(input_ids, self.base.embed_tokens.weight)
        cos, sin = self.rope(positions, h.dtype)
        N = h.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = rms_norm(h, layer.input_layernorm)
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(N, -1, self.head_dim)
            k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(N, -1, self.head_dim)
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(N, -1, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if q_ring is not None and ctx.ring_src is not None:
                q_ring[i][ctx.ring_dst] = q[ctx.ring_src]
            o = paged_attention(q, k, v, k_cache[i], v_cache[i], ctx, self.scale)
            h = h + F.linear(o.reshape(N, -1), attn.o_proj.weight, attn.o_proj.bias)
            x = rms_norm(h, layer.post_attention_layernorm)
            mlp = layer.mlp
            gate = mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
            up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            h = h + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return rms_norm(h, self.base.norm)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head product in the model dtype (the fused sampler reads it as is)."""
        head = self.model.lm_head
        return F.linear(hidden, head.weight, head.bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from the model-dtype lm_head product (as HF computes them)."""
        return self.head(hidden).float()
