"""The Triton elementwise kernels of layers/fused_ops against the PyTorch operations they
replace (models.py's reference path), under Triton's interpreter; and the whole kernel
forward of CausalLM against the reference forward. test_gpu_kernels.py runs the compiled
kernels on CUDA (a separate module: the interpreter switch is process-wide)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minisparse.engine.models as models_mod
from engine_helpers import build, make_engine, prompts
from minisparse.engine import SamplingParams
from minisparse.engine.models import rms_norm, rotate_half
from triton_interpreter import import_interpreted

DEVICES = ["cpu"]


@pytest.fixture(scope="module")
def ops():
    return import_interpreted("minisparse.engine.layers.fused_ops")


def _ops(ops, device):
    """The module under test: interpreted here, compiled from test_gpu_kernels.py."""
    return ops


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the rounding the compiled kernels may do differently from PyTorch:
    bf16 within about one bf16 ulp (the interpreter's float32 -> bf16 casts truncate
    instead of rounding, Triton 3.6; on an H200 the compiled kernel's reduction and FMA
    order moved single values by one ulp), float32 on CUDA within float32 rounding (the
    compiler contracts x * cos + r * sin into an FMA), and float32 on the CPU exactly."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    elif got.is_cuda:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, want)


class _Norm(torch.nn.Module):
    def __init__(self, w: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = w, eps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(ops, device, dtype):
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(5, 96, generator=g).to(device, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
    out, h = _ops(ops, device).add_rms_norm(x, res, w, 1e-6)
    _same(h, res + x)
    tol = dict(atol=1e-6, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(out, rms_norm(res + x, _Norm(w, 1e-6)), **tol)
    out, h = _ops(ops, device).add_rms_norm(x, None, w, 1e-6)
    assert h is x
    torch.testing.assert_close(out, rms_norm(x, _Norm(w, 1e-6)), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_partials_summed_by_add_rms_norm(ops, device, dtype):
    """split_k_linear's float32 partials, summed inside add_rms_norm, give F.linear's
    product rounded once to the model dtype, then the same residual add and RMSNorm."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 96, generator=g).to(device, dtype)
    wt = (torch.randn(40, 96, generator=g) / 10).to(device, dtype)
    res = torch.randn(6, 40, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(device, dtype)
    k = _ops(ops, device)
    parts = k.split_k_linear(x, wt, 3)
    assert parts.shape == (3, 6, 40) and parts.dtype == torch.float32
    exact = (x.double() @ wt.double().T)
    torch.testing.assert_close(parts.double().sum(0), exact, atol=1e-4, rtol=1e-4)
    prod = (parts[0] + parts[1] + parts[2]).to(dtype)  # summed in order, rounded once
    tol = dict(atol=1e-6, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    for residual, want_h in ((res, res + prod), (None, prod)):
        out, h = k.add_rms_norm(parts, residual, w, 1e-6)
        _same(h, want_h)
        torch.testing.assert_close(out, rms_norm(h, _Norm(w, 1e-6)), **tol)
    with pytest.raises(ValueError, match="do not divide"):
        k.split_k_linear(x, wt, 5)


def test_o_split_parts_follow_the_measured_rule(ops):
    """The 1.5B's output projection (1,536 x 1,536) runs as four parts of 384 inputs up to
    128 rows and whole above; the 3B's (2,048) in four too; the 7B's (3,584: 28 output
    tiles) and one of 64 inputs never."""
    assert [ops.o_split_parts(r, 1536, 1536, 132) for r in (1, 16, 64, 128, 129, 256)] == \
        [4, 4, 4, 4, 1, 1]
    assert [ops.o_split_parts(r, 2048, 2048, 132) for r in (16, 128, 129)] == [4, 4, 1]
    assert ops.o_split_parts(16, 3584, 3584, 132) == 1
    assert ops.o_split_parts(16, 64, 64, 132) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("HQ,HKV", [(4, 2), (6, 2), (6, 3)])
def test_rope_and_cache_write(ops, device, dtype, HQ, HKV):
    """Any head counts: the kernel pads them to powers of two and masks the padding (the
    NaN-filled cache shows a stray write, the q written is compared whole)."""
    g = torch.Generator().manual_seed(2)
    T, D, S = 6, 16, 20
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).to(device, dtype)
    ang = torch.rand(T, 1, D, generator=g) * 6
    cos, sin = ang.cos().to(device, dtype), ang.sin().to(device, dtype)
    slots = torch.randperm(S, generator=g)[:T].to(device)
    k_cache = torch.full((S, HKV, D), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    q = _ops(ops, device).rope_and_cache(qkv, cos, sin, slots, k_cache, v_cache, HQ, HKV)
    rq, rk, rv = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    rq, rk, rv = rq.reshape(T, HQ, D), rk.reshape(T, HKV, D), rv.reshape(T, HKV, D)
    _same(q, rq * cos + rotate_half(rq) * sin)
    _same(k_cache[slots], rk * cos + rotate_half(rk) * sin)
    assert torch.equal(v_cache[slots], rv)
    untouched = torch.ones(S, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert bool(k_cache[untouched].isnan().all()) and bool(v_cache[untouched].isnan().all())


@pytest.mark.parametrize("device", DEVICES)
def test_rope_writes_query_ring_rows(ops, device):
    """Tokens with a ring row >= 0 put their rotated q there, the others write no row."""
    g = torch.Generator().manual_seed(4)
    T, HQ, HKV, D, S, R = 5, 4, 2, 16, 12, 7
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).to(device)
    ang = torch.rand(T, 1, D, generator=g) * 6
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    slots = torch.randperm(S, generator=g)[:T].to(device)
    k_cache = torch.zeros(S, HKV, D, device=device)
    v_cache = k_cache.clone()
    ring = torch.full((R, HQ, D), float("nan"), device=device)
    rows = torch.tensor([3, -1, 0, -1, 6], device=device)
    q = _ops(ops, device).rope_and_cache(qkv, cos, sin, slots, k_cache, v_cache, HQ, HKV,
                                         ring, rows)
    assert torch.equal(ring[[3, 0, 6]], q[[0, 2, 4]])
    assert bool(ring[[1, 2, 4, 5]].isnan().all())
    with pytest.raises(ValueError, match="ring"):
        _ops(ops, device).rope_and_cache(qkv, cos, sin, slots, k_cache, v_cache, HQ, HKV,
                                         ring.transpose(0, 1), rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(ops, device, dtype):
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(3, 2 * 1500, generator=g) * 4).to(device, dtype)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(_ops(ops, device).silu_mul(gu), F.silu(gate) * up,
                               atol=1e-6, rtol=2e-2 if dtype == torch.bfloat16 else 1e-6)


def test_rope_supported(ops):
    """Head counts of every supported shape (12 and 28 query heads too); head_dim must be
    a power of two."""
    assert ops.rope_supported(16, 2, 128) and ops.rope_supported(12, 2, 128)
    assert ops.rope_supported(28, 4, 128) and not ops.rope_supported(16, 2, 96)


@pytest.mark.parametrize("switch", [True, False])
def test_fused_kernels_switch_picks_the_forward(ops, monkeypatch, qwen2, switch):
    """engine.fused_kernels reaches CausalLM: with it off the forward stays on the PyTorch
    path even where the kernels are there (here: the interpreted ones, offered for CPU)."""
    monkeypatch.setattr(models_mod, "fused_ops", lambda h: ops)
    engine = make_engine(qwen2, fused_kernels=switch)
    engine.lm.fuse = True
    engine.lm.fuse_weights()
    h = torch.zeros(1, qwen2.config.hidden_size)
    assert engine.lm.fused_kernels is switch and engine.lm._use_kernels(h) is switch


@pytest.mark.parametrize("fused_decode,split,heads", [(False, False, 4), (True, False, 4),
                                                      (True, True, 4), (True, False, 6)])
def test_kernel_forward_matches_reference_forward(ops, monkeypatch, qwen2, fused_decode,
                                                  split, heads):
    """The whole engine on the kernel path (interpreted) vs the reference path: same greedy
    tokens, log-probs equal to float32 rounding, dense and with the query ring (R-KV).
    fused_decode: decode steps run RoPE + cache write + attention as one kernel (as on
    CUDA), else RoPE + cache write, then the PyTorch decode attention (as on CPU).
    split: the output and down projections run as split_k_linear's partials (the tiny
    model's are too shallow to be split under the GPU's rules, so the rules' depths are
    lowered).
    heads: query heads (6: not a power of two, as the Qwen2.5-1.5B's 12)."""
    from minisparse.config.schema import CompressConfig

    if heads != 4:
        qwen2 = build("qwen2", hidden_size=16 * heads, num_attention_heads=heads)

    ps = prompts(2, lo=4, hi=12)
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    cfg = CompressConfig(algorithm="rkv", budget=12, window=4, divide_length=4, kernel_size=3)
    want = [make_engine(qwen2, c, page_size=4).generate(ps, params) for c in (None, cfg)]
    monkeypatch.setattr(models_mod, "fused_ops", lambda h: ops)
    monkeypatch.setattr(models_mod.CausalLM, "_use_kernels", lambda self, h: bool(self.fused))
    calls = []
    if fused_decode:
        decode = import_interpreted("minisparse.engine.layers.triton_decode")
        kernel = decode.rope_decode_attention
        monkeypatch.setattr(decode, "rope_decode_attention",
                            lambda *a, **k: calls.append(1) or kernel(*a, **k))
        monkeypatch.setattr(models_mod, "decode_kernels", lambda h: decode)
    splits = []
    if split:
        monkeypatch.setattr(ops, "MIN_SPLIT_INNER", 8)
        monkeypatch.setattr(ops, "O_MIN_SPLIT_INNER", 8)
        split_k = ops.split_k_linear
        monkeypatch.setattr(ops, "split_k_linear",
                            lambda x, w, parts: splits.append((tuple(w.shape), parts))
                            or split_k(x, w, parts))
    for c, ref in zip((None, cfg), want):
        engine = make_engine(qwen2, c, page_size=4)
        engine.lm.fuse = True
        engine.lm.fuse_weights()
        got = engine.generate(ps, params)
        for a, b in zip(got, ref):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert bool(calls) == fused_decode
    assert bool(splits) == split and all(p > 1 for _, p in splits)
    if split:  # both projections: o [hidden, hidden] and down [hidden, intermediate]
        c = qwen2.config
        assert {s for s, _ in splits} == {(c.hidden_size, c.hidden_size),
                                          (c.hidden_size, c.intermediate_size)}
    assert build("llama").config.hidden_act == "silu"
