import pytest
import torch
from policy_models import tiny_qwen2

from minisparse.config.schema import ConfigError
from minisparse.models import attention
from minisparse.models.attention import (
    FLASH_NAME,
    NAME,
    _per_sequence_sdpa,
    flash_attn_missing,
    packing_kwargs,
    resolve_attention,
    use_attention,
    varlen_attention_forward,
)
from minisparse.trainer.logprobs import response_logprobs


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
    for kind in ("varlen", "auto"):
        words = use_attention(model, kind)
        assert model.config._attn_implementation == NAME
        assert words == (f"per-sequence SDPA attention (model.attention={kind}: "
                         f"the policy is not on a CUDA GPU)")
    assert use_attention(model, "sdpa").startswith("transformers' SDPA attention")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attention must be one of auto, flash_attn, varlen, sdpa"):
        use_attention(model, "flash")


def _on_gpu(monkeypatch, capability, installed=True, first_call=None):
    """Pretend the (CPU) model sits on a GPU of this compute capability."""
    monkeypatch.setattr(attention, "_gpu_capability", lambda device: ("GPU X", capability))
    monkeypatch.setattr(attention, "_flash_installed", lambda: installed)
    monkeypatch.setattr(attention, "_flash_first_call", lambda *shape: first_call)


def test_flash_attn_asked_for_where_it_cannot_run_names_why(monkeypatch):
    model = tiny_qwen2(vocab=31, hidden=64, layers=1, heads=4, kv_heads=2)  # head dim 16
    with pytest.raises(ConfigError,
                       match="model.attention=flash_attn but the policy is not on a CUDA GPU"):
        use_attention(model, "flash_attn")
    _on_gpu(monkeypatch, (8, 0))
    with pytest.raises(ConfigError, match=r"GPU X, compute capability 8\.0\) is neither Hopper"):
        use_attention(model, "flash_attn")
    _on_gpu(monkeypatch, (9, 0), installed=False)
    with pytest.raises(ConfigError, match="flash-attn-4 is not installed"):
        use_attention(model, "flash_attn")
    _on_gpu(monkeypatch, (9, 0))
    assert flash_attn_missing(model) == ("model.dtype is float32; flash-attn-4 runs "
                                         "bfloat16 or float16")
    model.to(torch.bfloat16)
    assert flash_attn_missing(model) is None
    _on_gpu(monkeypatch, (9, 0), first_call="flash-attn-4 failed a first call (boom)")
    with pytest.raises(ConfigError, match=r"flash-attn-4 failed a first call \(boom\)"):
        use_attention(model, "flash_attn")
    assert model.config._attn_implementation == "sdpa"  # left as it was


def test_flash_attn_head_dims_per_gpu(monkeypatch):
    narrow = tiny_qwen2(vocab=31, hidden=16, layers=1, heads=4, kv_heads=2).bfloat16()
    wide = tiny_qwen2(vocab=31, hidden=192, layers=1, heads=1, kv_heads=1).bfloat16()
    _on_gpu(monkeypatch, (9, 0))
    assert flash_attn_missing(narrow) == ("head dim 4 is not one flash-attn-4 takes on "
                                          "Hopper (a multiple of 8 from 8 to 256)")
    assert flash_attn_missing(wide) is None  # 192 on Hopper
    _on_gpu(monkeypatch, (10, 0))
    assert "head dim 192 is not one flash-attn-4 takes on Blackwell" in flash_attn_missing(wide)


def test_auto_takes_flash_attn_where_it_runs_else_varlen(monkeypatch):
    model = tiny_qwen2(vocab=31, hidden=64, layers=1, heads=4, kv_heads=2).bfloat16()
    _on_gpu(monkeypatch, (9, 0))
    assert resolve_attention(model, "auto") == (
        "flash_attn", "flash-attn-4 varlen attention (model.attention=auto)")
    assert resolve_attention(model, "varlen")[0] == "varlen"  # asked for by name
    for capability, installed in (((8, 6), True), ((9, 0), False)):
        _on_gpu(monkeypatch, capability, installed)
        assert resolve_attention(model, "auto")[0] == "varlen"
    _on_gpu(monkeypatch, (10, 0), first_call="flash-attn-4 failed a first call (boom)")
    assert resolve_attention(model, "auto")[0] == "varlen"


def test_auto_on_hopper_hands_the_flash_path_each_layers_packed_lengths(monkeypatch):
    """On a pretended Hopper GPU `auto` takes the flash attention, and the log-prob pass
    hands it the packing, one call a layer. On the CPU that call runs per sequence, so
    this checks the dispatch, not flash-attn-4's numbers: tests/models/test_flash_attn_gpu.py
    compares those with torch's kernel on a GPU."""
    model = tiny_qwen2(vocab=97, hidden=32, layers=2, heads=4, kv_heads=2).eval()
    prompts, responses = [[1, 2, 3], [4, 5], [6]], [[7, 8], [9, 10, 11], [12, 13]]
    calls = []
    monkeypatch.setattr(attention, "_per_sequence_sdpa",
                        lambda *a: calls.append(a[3]) or _per_sequence_sdpa(*a))
    with torch.no_grad():
        use_attention(model, "varlen")
        ref, _ = response_logprobs(model, prompts, responses, width=3)
        _on_gpu(monkeypatch, (9, 0))
        monkeypatch.setattr(attention, "flash_attn_missing", lambda model: None)  # float32
        use_attention(model, "auto")
        assert model.config._attn_implementation == FLASH_NAME
        calls.clear()
        logp, _ = response_logprobs(model, prompts, responses, width=3)
    assert calls == [(5, 5, 3)] * 2  # one call a layer, with the packed lengths
    torch.testing.assert_close(logp, ref, rtol=0, atol=0)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_policy_on_a_gpu_runs_per_sequence():
    """The varlen kernels take bf16 / fp16: a float32 policy (tiny_rkv on a GPU) is told so
    at start and its packed passes run per sequence, with the CPU's numbers."""
    from minisparse.trainer.logprobs import batch_logprobs

    model = tiny_qwen2(vocab=97, hidden=32, layers=2, heads=4, kv_heads=2).eval()
    prompts, responses = [[1, 2, 3], [4, 5]], [[7, 8], [9, 10, 11]]
    want = batch_logprobs(model, prompts, responses, 3, 64)
    model.cuda()
    for kind in ("auto", "varlen"):
        words = use_attention(model, kind)
        assert words == (f"per-sequence SDPA attention (model.attention={kind}: model.dtype "
                         f"is float32; the varlen kernels run bfloat16 or float16)")
        torch.testing.assert_close(batch_logprobs(model, prompts, responses, 3, 64), want,
                                   rtol=1e-4, atol=1e-4)


def test_cute_build_notice_is_left_out_and_other_warnings_stay():
    import warnings

    from minisparse.models.attention import quiet_cute_builds

    notice = ("Argument aux_data (position 17) cannot be converted to a JitArgument for "
              "function 'cutlass___call___flash_attncuteflash_fwd_sm90'. Its type is not "
              "supported.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_cute_builds.cache_clear()
        quiet_cute_builds()
        warnings.warn(notice, UserWarning)
        warnings.warn("Argument x cannot be converted", UserWarning)
    quiet_cute_builds.cache_clear()  # the filter left with catch_warnings
    assert [str(w.message) for w in seen] == ["Argument x cannot be converted"]
