"""Narrow projections at decode batch sizes: cuBLAS's F.linear followed by the add +
RMSNorm kernel, against split_k_linear (our split of the inner dimension, one batched
GEMM with float32 partials) whose partials that kernel sums. Both pairs run for 36 layers
of distinct weights (no L2 reuse across layers) inside one CUDA graph; the table gives
microseconds per layer, median of 7 timings of 10 replays.

    python scripts/sweep_split_k.py [--m 256 1024] [--splits 2 4 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from minisparse.engine.layers import fused_ops as ops  # noqa: E402

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "down": (2048, 11008)}  # N, K (3B shape)
LAYERS = 36


def graph_us(fn, reps: int = 10) -> float:
    """Median microseconds of one fn() call per layer, fn capturing all layers."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()  # warm-up: Triton compile, cuBLAS handles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps / LAYERS)
    return statistics.median(times)


def check(x, w, res, nw, parts) -> float:
    """Largest |difference| of the split path's normed output from F.linear's, in units
    of the output's largest magnitude (both round the product once to bf16)."""
    ref, _ = ops.add_rms_norm(F.linear(x, w), res, nw, 1e-6)
    out, _ = ops.add_rms_norm(ops.split_k_linear(x, w, parts), res, nw, 1e-6)
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 3, 4, 6, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for name in args.shapes:
        N, K = SHAPES[name]
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(LAYERS)]
        nw = torch.rand(N, device=dev, dtype=torch.bfloat16) + 0.5
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            res = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "M": M}
            row["linear"] = graph_us(lambda: [F.linear(x, w) for w in ws])
            row["linear+norm"] = graph_us(
                lambda: [ops.add_rms_norm(F.linear(x, w), res, nw, 1e-6) for w in ws])
            for p in args.splits:
                if K % p or (K // p) % 8:
                    continue
                row[f"s{p}"] = graph_us(lambda: [ops.split_k_linear(x, w, p) for w in ws])
                row[f"s{p}+norm"] = graph_us(
                    lambda: [ops.add_rms_norm(ops.split_k_linear(x, w, p), res, nw, 1e-6)
                             for w in ws])
                row[f"s{p}_err"] = check(x, ws[0], res, nw, p)
            best = min((k for k in row if k.endswith("+norm") and k != "linear+norm"),
                       key=row.get)
            print(f"{name:5s} M={M:5d} linear {row['linear']:6.1f} +norm "
                  f"{row['linear+norm']:6.1f} | " + " ".join(
                      f"{k[:-5]} {row[k[:-5]]:5.1f}/{row[k]:5.1f}" for k in row
                      if k.endswith("+norm") and k != "linear+norm")
                  + f" | best {best[:-5]} {row['linear+norm'] / row[best]:.2f}x"
                  f" err {row[best[:-5] + '_err']:.1e}", flush=True)
        del ws


if __name__ == "__main__":
    main()
