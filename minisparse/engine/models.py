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

from minisparse.engine.layers import paged_decode
from minisparse.engine.layers.attention import AttnContext, attend, paged_attention
from minisparse.utils.kernels import triton_module


def fused_ops(h: torch.Tensor):
    """The Triton elementwise kernels (layers.fused_ops) for CUDA tensors, None elsewhere
    or without Triton."""
    return triton_module("minisparse.engine.layers.fused_ops", h)


def decode_kernels(h: torch.Tensor):
    """The Triton decode-attention module whose rope_decode_attention a CUDA decode step
    uses (None off CUDA: the CPU forward writes the cache, then attends)."""
    return paged_decode.triton_kernels(h)


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """Same arithmetic as Qwen2RMSNorm / LlamaRMSNorm (float32 statistics)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CausalLM:
    """Forward over a bound HF causal LM. Supports GQA, qkv/mlp biases, tied embeddings.

    fuse=True keeps a rollout-time copy of each layer's q/k/v and gate/up weights
    concatenated (one GEMM each instead of three and two; at decode batch sizes the small
    k/v products and the extra launches cost more than the copy's memory). The copy is made
    at bind() (update_weights) and on demand, dropped by release_fused() (sleep), and
    fused_bytes reports its size; in-place weight updates are seen only after the next
    bind(), which is when the trainer pushes new weights anyway. fused_kernels: on CUDA,
    run the elementwise stages as layers.fused_ops' Triton kernels (EngineConfig's switch
    of the same name)."""

    def __init__(self, model: nn.Module, fuse: bool = False, fused_kernels: bool = True) -> None:
        self.fuse, self.fused_kernels = fuse, fused_kernels
        self.fused: list[tuple] | None = None
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
        self.release_fused()
        if self.fuse:
            self.fuse_weights()

    def fuse_weights(self) -> None:
        """(Re)build the concatenated qkv and gate/up weights from the bound modules."""
        self.release_fused()

        def cat(*mods):
            w = torch.cat([m.weight.detach() for m in mods])
            bias = [m.bias for m in mods]
            b = None if bias[0] is None else torch.cat([x.detach() for x in bias])
            return w, b

        self.fused = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            if (a.k_proj.bias is None) != (a.q_proj.bias is None) or m.up_proj.bias is not None:
                raise NotImplementedError("fused weights need uniform q/k/v biases and "
                                          "bias-free gate/up projections")
            self.fused.append((*cat(a.q_proj, a.k_proj, a.v_proj), cat(m.gate_proj, m.up_proj)[0]))

    def release_fused(self) -> None:
        self.fused = None

    @property
    def fused_bytes(self) -> int:
        if not self.fused:
            return 0
        return sum(t.numel() * t.element_size() for f in self.fused for t in f if t is not None)

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
        if self._use_kernels(h):
            return self._forward_kernels(h, cos, sin, ctx, k_cache, v_cache, q_ring)
        N = h.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = rms_norm(h, layer.input_layernorm)
            q, k, v = self._qkv(i, x)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if q_ring is not None and ctx.ring_src is not None:
                q_ring[i][ctx.ring_dst] = q[ctx.ring_src]
            o = paged_attention(q, k, v, k_cache[i], v_cache[i], ctx, self.scale)
            h = h + F.linear(o.reshape(N, -1), attn.o_proj.weight, attn.o_proj.bias)
            x = rms_norm(h, layer.post_attention_layernorm)
            mlp = layer.mlp
            if self.fused:
                gate, up = F.linear(x, self.fused[i][2]).chunk(2, dim=-1)
                gate = mlp.act_fn(gate)
            else:
                gate = mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
                up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            h = h + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return rms_norm(h, self.base.norm)

    def runs_kernels(self, device: torch.device) -> bool:
        """Whether forwards on `device` take the fused Triton kernels (the rollout
        metrics and the bench report it: a shape the kernels refuse falls back silently)."""
        return self._use_kernels(torch.empty(0, device=device, dtype=self.dtype))

    def _use_kernels(self, h: torch.Tensor) -> bool:
        """The Triton path needs fused_kernels on, CUDA, the fused weights, SiLU and
        a power-of-two head_dim."""
        ops = fused_ops(h) if self.fused_kernels and self.fused else None
        if ops is None:
            return False
        act = getattr(self.model.config, "hidden_act", "silu")
        return act == "silu" and ops.rope_supported(self.num_heads, self.num_kv_heads,
                                                    self.head_dim)

    def _forward_kernels(self, h, cos, sin, ctx, k_cache, v_cache, q_ring) -> torch.Tensor:
        """forward() with one Triton kernel per elementwise stage (layers.fused_ops): each
        residual add rides with the next RMSNorm, RoPE writes K/V (and the query ring)
        straight into the pool (in a decode step, inside the attention kernel:
        triton_decode.rope_decode_attention), SiLU(gate) * up reads the fused gate/up
        product. Same roundings as forward()."""
        ops, N = fused_ops(h), h.shape[0]
        norms = [layer.input_layernorm for layer in self.layers]
        ring_rows = None  # per token: its query-ring row, -1 when it keeps none
        if q_ring is not None and ctx.ring_src is not None:
            ring_rows = torch.full((N,), -1, dtype=torch.long, device=h.device)
            ring_rows[ctx.ring_src] = ctx.ring_dst
        decode = decode_kernels(h) if ctx.is_decode else None
        sms = ops.num_sms(h.device)  # the parts follow every layer's shapes
        down_parts = ops.split_k_parts(N, *self.layers[0].mlp.down_proj.weight.shape, sms)
        o_parts = ops.o_split_parts(N, *self.layers[0].self_attn.o_proj.weight.shape, sms)
        x, h = ops.add_rms_norm(h, None, norms[0].weight, norms[0].variance_epsilon)
        for i, layer in enumerate(self.layers):
            attn, (w_qkv, b_qkv, w_gu) = layer.self_attn, self.fused[i]
            qkv = F.linear(x, w_qkv, b_qkv)
            ring = q_ring[i] if ring_rows is not None else None
            if decode:  # RoPE, cache and ring writes inside the attention kernel
                o = decode.rope_decode_attention(
                    qkv, cos, sin, ctx.slot_mapping, k_cache[i], v_cache[i], ctx.page_table,
                    ctx.rows, ctx.cache_lens, ctx.page_size, self.scale, self.num_heads, ring,
                    ring_rows, max_len=ctx.max_len)
            else:
                q = ops.rope_and_cache(qkv, cos, sin, ctx.slot_mapping, k_cache[i], v_cache[i],
                                       self.num_heads, self.num_kv_heads, ring, ring_rows)
                o = attend(q, k_cache[i], v_cache[i], ctx, self.scale)
            o = self._split_linear(ops, attn.o_proj, o.reshape(N, -1), o_parts)
            post = layer.post_attention_layernorm
            x, h = ops.add_rms_norm(o, h, post.weight, post.variance_epsilon)
            o = self._split_linear(ops, layer.mlp.down_proj, ops.silu_mul(F.linear(x, w_gu)),
                                   down_parts)
            nxt = norms[i + 1] if i + 1 < len(norms) else self.base.norm
            x, h = ops.add_rms_norm(o, h, nxt.weight, nxt.variance_epsilon)
        return x

    @staticmethod
    def _split_linear(ops, linear: nn.Linear, act: torch.Tensor, parts: int) -> torch.Tensor:
        """The down or output projection, as float32 partial products when it has too few
        output tiles to fill the GPU (parts > 1, from fused_ops.split_k_parts or
        o_split_parts); the next add_rms_norm sums them."""
        if parts > 1 and linear.bias is None and linear.weight.is_contiguous() \
                and act.is_contiguous():
            return ops.split_k_linear(act, linear.weight, parts)
        return F.linear(act, linear.weight, linear.bias)

    def _qkv(self, i: int, x: torch.Tensor):
        """q [N, H_q, D], k and v [N, H_kv, D] of layer i: one GEMM when fused."""
        N, D = x.shape[0], self.head_dim
        if self.fused:
            w, b = self.fused[i][:2]
            qkv = F.linear(x, w, b)
            q, k, v = qkv.split([self.num_heads * D, self.num_kv_heads * D,
                                 self.num_kv_heads * D], dim=-1)
            return q.view(N, -1, D), k.view(N, -1, D), v.view(N, -1, D)
        attn = self.layers[i].self_attn
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(N, -1, D)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(N, -1, D)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(N, -1, D)
        return q, k, v

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head product in the model dtype (the fused sampler reads it as is)."""
        head = self.model.lm_head
        return F.linear(hidden, head.weight, head.bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from the model-dtype lm_head product (as HF computes them)."""
        return self.head(hidden).float()
