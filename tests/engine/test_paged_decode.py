"""Paged decode attention against a float64 per-token reference: the PyTorch reference path
always, the Triton kernel under the interpreter on CPU (TRITON_INTERPRET=1, tiny shapes).

Every slot a sequence does not own holds NaN, so any read outside 0..cache_len-1 (page
tails, spare pages, unused page-table entries) would turn the output into NaN."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisparse.engine.layers.paged_decode import paged_decode_attention, paged_decode_reference

from paged_decode_cases import interpreted_triton_decode, make_case, naive_reference, rel_err
from triton_interpreter import import_interpreted

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _lens(page_size: int) -> list[int]:
    return [1, page_size - 1, page_size, 3 * page_size + 5, 150]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_q,h_kv,D,page_size", [(4, 2, 64, 16), (7, 1, 128, 32)])
def test_reference_matches_naive(dtype, h_q, h_kv, D, page_size):
    c = make_case(_lens(page_size), h_q, h_kv, D, page_size, dtype, seed=1)
    out = paged_decode_reference(*c.args())
    assert out.dtype == dtype and out.shape == c.q.shape
    assert rel_err(out, naive_reference(c)) < TOL[dtype]


def test_dispatch_on_cpu_uses_reference():
    c = make_case([5, 40], 4, 2, 64, 16, torch.float32, seed=2)
    torch.testing.assert_close(paged_decode_attention(*c.args(), max_len=40),
                               paged_decode_reference(*c.args()), rtol=0, atol=0)


def test_reference_zero_length_gives_zeros():
    c = make_case([0, 9], 4, 2, 64, 16, torch.float32, seed=3)
    out = paged_decode_reference(*c.args())
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], naive_reference(c)[1:]) < 1e-5


# ---- Triton kernel (interpreter on CPU, compiled on CUDA) ---------------------------------

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def td():
    """The kernel module: compiled on CUDA, else under Triton's CPU interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        from minisparse.engine.layers import triton_decode

        return triton_decode
    return interpreted_triton_decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,h_kv,D,page_size", [(8, 1, 128, 16), (7, 1, 64, 32),
                                                  (4, 2, 64, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_matches_naive(td, dtype, h_q, h_kv, D, page_size, num_splits):
    c = make_case(_lens(page_size), h_q, h_kv, D, page_size, dtype, device=DEV, seed=4)
    out = td.paged_decode_attention(*c.args(), num_splits=num_splits)
    assert out.dtype == dtype and out.shape == c.q.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, naive_reference(c)) < TOL[dtype]


def test_triton_empty_splits_and_odd_page_size(td):
    """More splits than a short sequence has blocks (its later splits are empty and must
    drop out of the merge), a non-power-of-two page size and block_n below page_size."""
    c = make_case([3, 70, 1], 4, 1, 64, 24, torch.float32, device=DEV, seed=5)
    ref = naive_reference(c)
    for splits, block_n in [(5, 16), (2, 32)]:
        out = td.paged_decode_attention(*c.args(), num_splits=splits,
                                                   block_n=block_n)
        assert rel_err(out, ref) < 1e-4


def test_split_merge_counters_reset_for_the_next_launch(td):
    """The last split to finish merges and zeroes its counter, so a second launch (a CUDA
    graph's next replay) merges again, with the same result."""
    c = make_case([40, 9, 77], 8, 2, 64, 16, torch.float32, device=DEV, seed=8)
    first = td.paged_decode_attention(*c.args(), num_splits=3, block_n=16)
    assert not td._COUNTERS[c.q.device][-1].any()
    again = td.paged_decode_attention(*c.args(), num_splits=3, block_n=16)
    assert torch.equal(first, again)
    assert rel_err(first, naive_reference(c)) < 1e-4


def test_triton_strided_q_zero_length_and_max_len(td):
    """q as a head slice of a fused projection (non-contiguous rows), a zero-length
    sequence (zeros) and a loose host-side max_len bound."""
    c = make_case([0, 33, 17], 4, 2, 64, 16, torch.float32, device=DEV, seed=6)
    fused = torch.randn(3, 8, 64, device=DEV)
    fused[:, :4] = c.q
    c.q = fused[:, :4]
    out = td.paged_decode_attention(*c.args(), max_len=64, num_splits=2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], naive_reference(c)[1:]) < 1e-4


@pytest.fixture(scope="module")
def rope_ops():
    """fused_ops, whose RoPE + cache write the fused decode kernel must reproduce."""
    if torch.cuda.is_available():
        from minisparse.engine.layers import fused_ops

        return fused_ops
    return import_interpreted("minisparse.engine.layers.fused_ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_rope_decode_matches_rope_then_attention(td, rope_ops, dtype, num_splits):
    """rope_decode_attention (RoPE, K/V write, ring write and attention in one kernel)
    against rope_and_cache followed by paged_decode_attention: the same cache and ring
    contents exactly, the same output up to where the new entry enters the softmax (last
    instead of in its block). Lengths put the new entry at a page start, a page end, inside
    a block and alone (length 1); with splits it lands in different splits."""
    page_size, h_q, h_kv, D = 16, 4, 2, 64
    lens = [1, 16, 17, 53, 150]
    B = len(lens)
    c = make_case(lens, h_q, h_kv, D, page_size, dtype, device=DEV, seed=7)
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(B, (h_q + 2 * h_kv) * D, generator=g).to(DEV, dtype)
    ang = torch.rand(B, 1, D, generator=g) * 6
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    last = c.cache_lens.long() - 1
    slots = c.page_table[c.rows, last // page_size] * page_size + last % page_size
    ring_rows = torch.tensor([3, -1, 0, 7, 9], device=DEV)
    caches, rings = [], []
    for fused in (False, True):
        k, v = c.k_cache.clone(), c.v_cache.clone()
        ring = torch.full((10, h_q, D), float("nan"), dtype=dtype, device=DEV)
        if fused:
            out = td.rope_decode_attention(qkv, cos, sin, slots, k, v, c.page_table, c.rows,
                                           c.cache_lens, page_size, c.scale, h_q, ring,
                                           ring_rows, num_splits=num_splits)
        else:
            q = rope_ops.rope_and_cache(qkv, cos, sin, slots, k, v, h_q, h_kv, ring, ring_rows)
            want = td.paged_decode_attention(q, k, v, c.page_table, c.rows, c.cache_lens,
                                             page_size, c.scale, num_splits=num_splits)
        caches.append((k, v))
        rings.append(ring)
    assert out.shape == want.shape and out.dtype == dtype
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    for a, b in zip(*caches):  # NaN poison elsewhere: compare as bytes
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(rings[0].view(torch.uint8), rings[1].view(torch.uint8))
    assert not rings[1][[3, 0, 7, 9]].isnan().any()


def test_rope_decode_rejects_a_qkv_of_the_wrong_width(td):
    c = make_case([4], 4, 2, 64, 16, torch.float32, device=DEV)
    qkv = torch.zeros(1, 7 * 64, device=DEV)
    with pytest.raises(ValueError, match="qkv"):
        td.rope_decode_attention(qkv, qkv[:, None, :64], qkv[:, None, :64], c.rows,
                                 c.k_cache, c.v_cache, c.page_table, c.rows, c.cache_lens,
                                 16, 1.0, 4)


def test_choose_splits(td):
    assert td.choose_splits(512, 4096, 132) == 1  # B=256 x 2 heads fill the GPU
    assert td.choose_splits(2, 16500, 132) == 64  # eval tail: capped
    assert td.choose_splits(8, 640, 132) == 3  # no split under 256 tokens
    assert td.choose_splits(64, 4096, 132) == 5


def test_fa3_comparison_names_what_is_missing():
    """bench_decode --fa3 without sgl-kernel: an error saying what to install (the command
    line says it before any timing, without a traceback)."""
    import importlib.util

    from minisparse.bench.decode import fa3_decode

    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("sgl-kernel is installed here")
    c = make_case([5, 9], 4, 2, 16, 4, torch.float32)
    with pytest.raises(RuntimeError, match="sgl-kernel"):
        fa3_decode(c, 9)
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "minisparse.bench.decode", "--fa3"],
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode != 0 and "needs sgl-kernel" in run.stderr
    assert "Traceback" not in run.stderr


def test_triton_rejects_bad_shapes(td):
    c = make_case([4], 4, 2, 64, 16, torch.float32, device=DEV)
    with pytest.raises(ValueError, match="head_dim"):
        td.paged_decode_attention(c.q[..., :48], c.k_cache[..., :48],
                                             c.v_cache[..., :48], *c.args()[3:])
    with pytest.raises(ValueError, match="block_n"):
        td.paged_decode_attention(*c.args(), block_n=24)
