"""The compiled Triton paged decode kernel on CUDA at real model shapes: against the float64
per-token reference (a few sequences, long caches) and against the PyTorch reference path
(full batches); prints, without asserting, its time next to the engine's gather + SDPA.

    pytest -s tests/engine/test_gpu_paged_decode.py
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from minisparse.engine.layers import triton_decode  # noqa: E402
from minisparse.engine.layers.paged_decode import (  # noqa: E402
    paged_decode_attention, paged_decode_reference)

from paged_decode_cases import make_case, naive_reference, rel_err  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
SHAPES = [(16, 2, 128), (28, 4, 128), (32, 8, 64)]  # Qwen2.5-3B, 7B, Llama-1B


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h_q,h_kv,D", SHAPES)
@pytest.mark.parametrize("page_size", [16, 64])
def test_long_and_ragged_vs_float64(dtype, h_q, h_kv, D, page_size):
    lens = [1, page_size - 1, page_size, 5 * page_size + 3, 4321, 16500]
    c = make_case(lens, h_q, h_kv, D, page_size, dtype, device="cuda", seed=11)
    ref = naive_reference(c)
    for splits in (None, 1, 7):  # heuristic (splits here), forced single, forced split-K
        out = triton_decode.paged_decode_attention(*c.args(), num_splits=splits)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[dtype], splits


@pytest.mark.parametrize("mean", [640, 4096])
def test_full_batch_vs_reference(mean):
    g = torch.Generator().manual_seed(mean)
    lens = torch.randint(int(mean * 0.9), int(mean * 1.1), (256,), generator=g).tolist()
    c = make_case(lens, 16, 2, 128, 16, torch.bfloat16, device="cuda", seed=12)
    out = paged_decode_attention(*c.args(), max_len=max(lens))  # the dispatcher -> Triton
    ref = paged_decode_reference(*c.args(), max_len=max(lens))
    assert rel_err(out, ref.double()) < 1e-2


@pytest.mark.parametrize("mean", [640, 4096])
def test_print_timing_vs_gather_sdpa(mean):
    from minisparse.bench.decode import bench_one, parse_args

    r = bench_one(256, mean, parse_args(["--rep", "100"]))
    print(f"\nB=256 L~{mean} bf16 16/2 D=128: triton {r['ms']:.4f} ms ({r['gbs']:.0f} GB/s), "
          f"gather+SDPA {r['sdpa_ms']:.4f} ms ({r['sdpa_gbs']:.0f} GB/s), "
          f"{r['speedup']:.2f}x, err {r['err']:.1e}")
    assert r["err"] < 1e-2


@pytest.mark.parametrize("mean", [640, 4096])
def test_fa3_from_sgl_kernel_on_the_same_pool(mean):
    """bench_decode --fa3: sgl-kernel's FA3 reads the engine's pool and page table as they
    are and agrees with the reference (where SGLang is installed)."""
    pytest.importorskip("sgl_kernel")
    from minisparse.bench.decode import bench_one, parse_args

    r = bench_one(256, mean, parse_args(["--rep", "100", "--fa3"]))
    print(f"\nB=256 L~{mean}: triton {r['ms']:.4f} ms, fa3 {r['fa3_ms']:.4f} ms "
          f"({r['fa3_gbs']:.0f} GB/s), fa3 err {r['fa3_err']:.1e}")
    assert r["fa3_err"] < 1e-2
