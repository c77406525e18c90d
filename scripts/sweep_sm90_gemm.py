"""The decode-batch projections of the 3B shape: cuBLAS (as the engine runs them) against
the wgmma kernels of scripts/gemm_sm90.cu, built here as a torch extension (nvcc, sm_90a).

Each kernel is first checked against torch, then timed: 36 layers of distinct weights in
one CUDA graph (no L2 reuse), microseconds per layer, median of 7 timings of 10 replays
(sweep_split_k.graph_us). At the end, one wave of tiles against the inner size separates
the main loop's rate from the fixed cost of a launch.

    python scripts/sweep_sm90_gemm.py [--m 256 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from minisparse.engine.layers import fused_ops as ops  # noqa: E402
from sweep_split_k import LAYERS, graph_us  # noqa: E402

BF16, PARTIALS, SILU_GATE_UP = 0, 1, 2  # the kernel's modes (gemm_sm90.cu)
HIDDEN, INTER, QKV = 2048, 11008, 2560  # the 3B shape


def build():
    """The extension, compiled for sm_90a only (a plain sm_90 pass rejects wgmma)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("sweep_sm90_gemm: needs a Hopper GPU (sm_90)")
    from torch.utils.cpp_extension import load
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    start = time.time()
    ext = load("minisparse_gemm_sm90", [str(HERE / "gemm_sm90.cu")],
               extra_cuda_cflags=["-O3", "-std=c++17"])
    print(f"built in {time.time() - start:.1f} s", flush=True)
    return ext


def weights(N: int, K: int, count: int) -> list[torch.Tensor]:
    """count random bf16 weights [N, K], scaled like a trained layer's (outputs ~ unit)."""
    return [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            for _ in range(count)]


def sm90(ext, x, w, bias=None, mode=BF16, splits=1, tile=256) -> torch.Tensor:
    M, N = x.shape[0], w.shape[0]
    shape = {BF16: (M, N), PARTIALS: (splits, M, N), SILU_GATE_UP: (M, N // 2)}[mode]
    out = torch.empty(shape, device=x.device,
                      dtype=torch.float32 if mode == PARTIALS else torch.bfloat16)
    ext.gemm(x, w, bias, out, mode, splits, tile, torch.cuda.current_stream().cuda_stream)
    return out


def check(ext, M: int) -> None:
    """Largest |difference| from torch: bf16 outputs against F.linear (same rounding), the
    partials' sum against float32 products, fused SiLU x up against the PyTorch path."""
    dev = torch.device("cuda")
    for N, K in ((QKV, HIDDEN), (HIDDEN, INTER), (2 * INTER, HIDDEN)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w, = weights(N, K, 1)
        b = torch.randn(N, device=dev, dtype=torch.bfloat16)
        for tile in (128, 256):
            if N == 2 * INTER:
                g, u = F.linear(x, w).chunk(2, dim=-1)
                err = (sm90(ext, x, w, None, SILU_GATE_UP, 1, tile).float()
                       - (F.silu(g) * u).float()).abs().max().item()
                print(f"check M={M} gate/up tile {tile}: silu x up max |diff| {err:.2e}")
                continue
            e_bf16 = (sm90(ext, x, w, b, BF16, 1, tile).float()
                      - F.linear(x, w, b).float()).abs().max().item()
            e_part = (sm90(ext, x, w, None, PARTIALS, 4, tile).sum(0)
                      - x.float() @ w.float().T).abs().max().item()
            print(f"check M={M} {N}x{K} tile {tile}: bf16 {e_bf16:.2e}, partials {e_part:.2e}")


def sweep(ext, M: int) -> None:
    dev = torch.device("cuda")
    x = torch.randn(M, HIDDEN, device=dev, dtype=torch.bfloat16)
    act = torch.randn(M, INTER, device=dev, dtype=torch.bfloat16)
    res = torch.randn(M, HIDDEN, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    norm = lambda y: ops.add_rms_norm(y, res, nw, 1e-6)  # noqa: E731
    each = lambda f, ws: (lambda: [f(w) for w in ws])  # noqa: E731
    rows = []
    ws = weights(QKV, HIDDEN, LAYERS)
    bias = torch.randn(QKV, device=dev, dtype=torch.bfloat16)
    rows.append(("q/k/v", "cuBLAS", graph_us(each(lambda w: F.linear(x, w, bias), ws))))
    for tile in (128, 256):
        rows.append(("q/k/v", f"sm90 tile {tile}",
                     graph_us(each(lambda w: sm90(ext, x, w, bias, BF16, 1, tile), ws))))
    ws = weights(HIDDEN, HIDDEN, LAYERS)
    rows.append(("o + norm", "cuBLAS", graph_us(each(lambda w: norm(F.linear(x, w)), ws))))
    for splits, tile in ((4, 128), (8, 256)):
        rows.append(("o + norm", f"sm90 {splits} splits, tile {tile}", graph_us(
            each(lambda w: norm(sm90(ext, x, w, None, PARTIALS, splits, tile)), ws))))
    ws = weights(HIDDEN, INTER, LAYERS)
    parts = ops.split_k_parts(M, HIDDEN, INTER, ops.num_sms(dev))
    rows.append(("down + norm", f"cuBLAS bmm, {parts} parts (engine)",
                 graph_us(each(lambda w: norm(ops.split_k_linear(act, w, parts)), ws))))
    for splits, tile in ((4, 128), (8, 256)):
        rows.append(("down + norm", f"sm90 {splits} splits, tile {tile}", graph_us(
            each(lambda w: norm(sm90(ext, act, w, None, PARTIALS, splits, tile)), ws))))
    ws = weights(2 * INTER, HIDDEN, LAYERS)
    rows.append(("gate/up + SiLU x up", "cuBLAS + Triton SiLU x up (engine)",
                 graph_us(each(lambda w: ops.silu_mul(F.linear(x, w)), ws))))
    for tile in (128, 256):
        rows.append(("gate/up + SiLU x up", f"sm90 fused, tile {tile}", graph_us(
            each(lambda w: sm90(ext, x, w, None, SILU_GATE_UP, 1, tile), ws))))
    for what, how, us in rows:
        print(f"M={M} | {what} | {how} | {us:.2f} us")


def wave_cost(ext) -> None:
    """One wave (a 128-row weight tile per SM) against the inner size K: the slope is the
    main loop's rate, the intercept what a launch costs besides it (start, first loads,
    epilogue)."""
    dev = torch.device("cuda")
    for M, tile in ((256, 256), (128, 128)):
        N = 128 * ops.num_sms(dev)
        for K in (64, 512, 1024, 2048, 4096, 8192):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ws = weights(N, K, 4)
            cublas = graph_us(lambda: [F.linear(x, ws[i % 4]) for i in range(LAYERS)])
            ours = graph_us(lambda: [sm90(ext, x, ws[i % 4], None, BF16, 1, tile)
                                     for i in range(LAYERS)])
            tflop = 2 * M * N * K / 1e6
            print(f"wave M={M} N={N} K={K} | cuBLAS {cublas:.2f} us ({tflop / cublas:.0f} "
                  f"TFLOP/s) | sm90 tile {tile} {ours:.2f} us ({tflop / ours:.0f} TFLOP/s)")
            del ws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[256, 128],
                    help="decode batch rows to time")
    args = ap.parse_args()
    ext = build()
    torch.manual_seed(0)
    for M in sorted(set(args.m + [17])):
        check(ext, M)
    for M in args.m:
        sweep(ext, M)
    wave_cost(ext)


if __name__ == "__main__":
    main()
