import pytest
import torch
from grpo_models import tiny_qwen2

from minisparse.grpo.attention import (
    NAME,
    _per_sequence_sdpa,
    packing_kwargs,
    use_attention,
    varlen_attention_forward,
)


def _qkv(lengths, hq=4, hkv=2, d=8, device="cpu", dtype=torch.float64, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    n = sum(lengths)
    mk = lambda h: torch.randn(1, h, n, d, generator=g, device=device, dtype=dtype)
    return mk(hq), mk(hkv), mk(hkv)


def _reference(q, k, v, lengths, scale):
    """Per sequence, eager softmax attention with GQA by repeating the KV heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        scores = q[:, :, s] @ k[:, :, s].transpose(-1, -2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(scores, -1) @ v[:, :, s])
        start += n
    return torch.cat(outs, 2).transpose(1, 2)


def test_packed_attention_equals_per_sequence_softmax():
    lengths = [5, 1, 7, 3]
    q, k, v = _qkv(lengths)
    out, weights = varlen_attention_forward(
        None, q, k, v, None, scaling=0.3, **packing_kwargs(lengths, q.device)
    )
    assert weights is None and out.shape == (1, 16, 4, 8)
    torch.testing.assert_close(out, _reference(q, k, v, lengths, 0.3), rtol=1e-12, atol=1e-12)


def test_unpacked_call_is_causal_over_the_row():
    q, k, v = _qkv([6], seed=1)
    out, _ = varlen_attention_forward(None, q, k, v, None, scaling=0.5)
    torch.testing.assert_close(out, _reference(q, k, v, [6], 0.5), rtol=1e-12, atol=1e-12)


def test_lengths_that_do_not_tile_the_row_are_named():
    q, k, v = _qkv([4, 4])
    with pytest.raises(ValueError, match=r"packed lengths \[4, 3\]"):
        varlen_attention_forward(None, q, k, v, None, **packing_kwargs([4, 3], q.device))
    with pytest.raises(ValueError, match="mask"):
        varlen_attention_forward(None, q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool))


def test_use_attention_switches_and_rejects_unknown():
    model = tiny_qwen2(vocab=31, hidden=16, layers=1, heads=2, kv_heads=1)
    use_attention(model, "varlen")
    assert model.config._attn_implementation == NAME
    use_attention(model, "sdpa")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attention must be one of varlen, sdpa"):
        use_attention(model, "flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_varlen_kernel_matches_per_sequence_sdpa():
    """bf16 flash varlen kernel vs per-sequence SDPA: outputs and q/k/v gradients."""
    lengths = [300, 17, 1024, 5, 700]
    results = []
    for use_varlen in (True, False):
        q, k, v = (t.requires_grad_() for t in _qkv(lengths, 16, 2, 128, "cuda", torch.bfloat16, 7))
        kw = packing_kwargs(lengths, q.device)
        if use_varlen:
            out, _ = varlen_attention_forward(None, q, k, v, None, scaling=128**-0.5, **kw)
        else:
            out = _per_sequence_sdpa(q, k, v, lengths, 128**-0.5).transpose(1, 2)
        g = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(3),
                        device="cuda", dtype=out.dtype)
        (out.float() * g.float()).sum().backward()
        results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        assert ((a - b).norm() / b.norm()).item() < 1e-2
