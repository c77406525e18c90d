"""The device side of a step, from device tensors only and without a host sync: the
decode forward and the sampling of final hidden states. ModelRunner runs them eagerly;
DecodeGraphs (cuda_graph.py) captures them as one decode graph.
"""
from __future__ import annotations

import torch

from minisparse.engine.config import SamplingParams
from minisparse.engine.kv_pool import KVPool
from minisparse.engine.layers.attention import AttnContext
from minisparse.engine.layers.sampler import sample
from minisparse.engine.models import CausalLM
from minisparse.utils.kernels import triton_module


def sample_hidden(lm: CausalLM, hidden: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs) on the device from final hidden states: the LM head, then the
    sampler: on CUDA the fused kernel (layers.sampler_triton) over the head's raw output,
    elsewhere the float32 reference (layers.sampler.sample)."""
    head_out = lm.head(hidden)
    fused = triton_module("minisparse.engine.layers.sampler_triton", head_out)
    if fused is not None:
        return fused.fused_sample(head_out, sp.temperature, sp.top_k, sp.top_p, seeds, steps)
    return sample(head_out.float(), sp.temperature, sp.top_k, sp.top_p, seeds, steps)


def decode_forward(lm: CausalLM, pool: KVPool, ids: torch.Tensor, pos: torch.Tensor,
                   rows: torch.Tensor, cidx: torch.Tensor, max_len: int) -> torch.Tensor:
    """Hidden states [B, hidden] of one decode step from device tensors only (token, RoPE
    position, page-table row, cache entry of each sequence; max_len >= every cidx + 1), so
    the same function runs eagerly and under CUDA-graph capture."""
    ring_src = ring_dst = None
    if pool.window:
        ring_src = torch.arange(ids.shape[0], device=ids.device)
        ring_dst = rows * pool.window + pos % pool.window
    ctx = AttnContext(pool.slot_of(rows, cidx), ring_src, ring_dst, page_table=pool.page_table,
                      rows=rows, cache_lens=cidx + 1, max_len=max_len, page_size=pool.page_size)
    return lm.forward(ids, pos, ctx, pool.k, pool.v, pool.q_ring)
