"""Sweep the split-K projection kernel (layers/splitk_linear) against what the engine runs
without it, on a CUDA GPU, inside CUDA graphs (as the decode step runs):

  down:  silu_mul(gate_up) -> F.linear(act, W_down) -> add_rms_norm(out, h)
         vs linear_parts(gate_up, W_down, silu_mul=True) -> add_rms_norm(parts, h)
  o:     F.linear(attn, W_o) -> add_rms_norm(out, h)
         vs linear_parts(attn, W_o) -> add_rms_norm(parts, h)

    python scripts/sweep_splitk.py --hidden 2048 --intermediate 11008 --batches 64,256,1024

Prints the best tiling per (projection, batch) and its speed-up, and writes every timing
as JSON (--out). The plan table in splitk_linear.py comes from these results.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from minisparse.engine.layers import fused_ops as ops
from minisparse.engine.layers.splitk_linear import SplitPlan, linear_parts


def graph_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20)


def candidates(M: int, N: int, K: int, sms: int):
    for bm, bn, bk, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (3, 4)):
        if bm > max(64, M) or (bn == 256 and bk == 128) or (bm == 128 and bn == 256 and stages == 4):
            continue
        tiles = -(-M // bm) * -(-N // bn)
        for splits in (1, 2, 3, 4, 6, 8, 11, 16):
            if tiles * splits > 4 * sms or K // splits < 4 * bk or (splits > 1 and tiles >= 2 * sms):
                continue
            yield SplitPlan(bm, bn, bk, splits, num_warps=8 if bn == 256 or bm * bn >= 128 * 128 else 4,
                            num_stages=stages)


def sweep(op: str, M: int, hidden: int, inter: int, sms: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    K = inter if op == "down" else hidden
    a = torch.randn(M, 2 * K if op == "down" else K, device=dev, dtype=dt, generator=g)
    w = torch.randn(hidden, K, device=dev, dtype=dt, generator=g) * K ** -0.5
    h = torch.randn(M, hidden, device=dev, dtype=dt, generator=g)
    nw = 1 + 0.1 * torch.randn(hidden, device=dev, dtype=dt, generator=g)
    silu = op == "down"

    def base():
        x = ops.silu_mul(a) if silu else a
        return ops.add_rms_norm(F.linear(x, w), h, nw, 1e-6)

    want = base()
    rows = {"op": op, "M": M, "N": hidden, "K": K, "cublas_ms": graph_ms(base), "plans": []}
    for p in candidates(M, hidden, K, sms):
        def new(p=p):
            return ops.add_rms_norm(linear_parts(a, w, p, silu_mul=silu), h, nw, 1e-6)
        try:
            got = new()
            err = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, want))
            ms = graph_ms(new)
        except Exception as e:  # out of shared memory and the like: not a candidate
            rows["plans"].append({"plan": p.__dict__, "error": type(e).__name__})
            continue
        rows["plans"].append({"plan": p.__dict__, "ms": ms, "max_err": err})
    ok = [r for r in rows["plans"] if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    rows["best"] = best
    if best:
        print(f"{op:5s} M={M:5d} N={hidden} K={K}: cuBLAS {rows['cublas_ms'] * 1e3:7.1f} us, "
              f"split-K {best['ms'] * 1e3:7.1f} us ({rows['cublas_ms'] / best['ms']:.2f}x) "
              f"{best['plan']} err {best['max_err']:.3g}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--batches", default="32,64,128,256,512,1024")
    ap.add_argument("--ops", default="down,o")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), sms, "SMs", flush=True)
    res = [sweep(op, M, args.hidden, args.intermediate, sms)
           for op in args.ops.split(",") for M in map(int, args.batches.split(","))]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
