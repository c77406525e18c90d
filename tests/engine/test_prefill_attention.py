"""Prefill attention over gathered cache slots (chunks at any position, a one-token tail
over a long cache, GQA) equals a per-token loop."""
from __future__ import annotations

import pytest
import torch

from minisparse.engine.layers.attention import AttnContext, _prefill_attention, prefill_sdpa


def _case(starts: list[int], lens: list[int], h_q: int, h_kv: int, D: int, seed: int = 0):
    """Chunks of lens[b] tokens at positions starts[b].. of sequences whose entries sit on
    random pool slots, laid out as model_runner.prefill lays them out."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lens), max(lens)
    L = max(s + n for s, n in zip(starts, lens))
    k_cache = torch.randn(B * L + 5, h_kv, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(B * L + 5, h_kv, D, generator=g, dtype=torch.float64)
    gather = torch.randperm(B * L + 5, generator=g)[: B * L].view(B, L)
    q = torch.randn(sum(lens), h_q, D, generator=g, dtype=torch.float64)
    offsets = torch.tensor([0, *lens[:-1]]).cumsum(0)
    t = torch.arange(T)
    lens_t = torch.tensor(lens)
    tt = torch.minimum(t[None, :], lens_t[:, None] - 1)
    pos = torch.tensor(starts)[:, None] + tt
    ctx = AttnContext(slot_mapping=torch.zeros(0, dtype=torch.long), gather_slots=gather,
                      mask=(torch.arange(L)[None, None, :] <= pos[:, :, None]).unsqueeze(1),
                      q_index=offsets[:, None] + tt,
                      token_rows=torch.arange(B * T).view(B, T)[t[None, :] < lens_t[:, None]])
    return q, k_cache, v_cache, ctx


def _loop(q, k_cache, v_cache, ctx, starts, lens, scale):
    G = q.shape[1] // k_cache.shape[1]
    out, i = torch.empty_like(q), 0
    for b, (s, n) in enumerate(zip(starts, lens)):
        for t in range(n):
            slots = ctx.gather_slots[b, : s + t + 1]
            for h in range(q.shape[1]):
                keys, values = k_cache[slots, h // G], v_cache[slots, h // G]
                out[i, h] = torch.softmax(keys @ q[i, h] * scale, 0) @ values
            i += 1
    return out


@pytest.mark.parametrize("h_q,h_kv", [(4, 2), (6, 1), (2, 2)])
def test_prefill_attention_equals_a_token_loop(h_q, h_kv):
    starts, lens = [0, 17, 6, 30], [5, 1, 9, 3]  # a first chunk, a 1-token tail, ...
    q, k, v, ctx = _case(starts, lens, h_q, h_kv, D=8)
    out = _prefill_attention(q, k, v, ctx, 0.3)
    torch.testing.assert_close(out, _loop(q, k, v, ctx, starts, lens, 0.3))


def test_prefill_sdpa_keeps_cudnn_out_on_cuda_only():
    """cuDNN's SDPA plans each new prefill shape anew (tens of ms a step on an H200): on
    CUDA the prefill runs the memory-efficient kernel (math where it cannot); elsewhere
    nothing changes."""
    before = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    with prefill_sdpa(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()  # takes no mask
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    with prefill_sdpa(torch.device("cpu")):
        assert (torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled()) == before
    assert (torch.backends.cuda.cudnn_sdp_enabled(),
            torch.backends.cuda.flash_sdp_enabled()) == before
