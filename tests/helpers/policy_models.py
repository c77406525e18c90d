"""Seeded tiny Qwen2 policies for the trainer's unit tests (sizes differ per test)."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
               max_positions: int = 128, seed: int = 0) -> Qwen2ForCausalLM:
    """A random Qwen2 with SDPA attention (the packed path's position_ids need it)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg)
