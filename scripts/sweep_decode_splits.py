"""Decode attention time (CUDA-graph replays) against its split count and tiling, at the
cache lengths rollouts of the 1.5B hold (--configs BxL), for each --splits value: whether
the split rule (triton_decode.choose_splits) and the tile (block_n 64, 4 warps) fit.

    python -m scripts.sweep_decode_splits --q-heads 12 --kv-heads 2 \
        --configs 16x224,16x768,64x224,64x768,256x224,256x768 --splits 1,2,3,4,6,8,12,16

Each replay runs the kernel over --layers caches of its own, as a decode step reads one
cache a layer (28 on the 1.5B), and reports the time a layer: a single cache replayed
stays in L2 where it fits (16 x 768 is 12.6 MB, 64 x 768 50 MB), which a step never sees.
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

from minisparse.bench.decode import make_case
from minisparse.engine.layers import triton_decode
from minisparse.engine.layers.fused_ops import num_sms


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="16x224,16x768,64x224,64x768,256x224,256x768")
    p.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    p.add_argument("--layers", type=int, default=28, help="distinct caches a replay reads")
    p.add_argument("--block-n", default="64", help="comma-separated tile lengths")
    p.add_argument("--warps", default="4", help="comma-separated warp counts")
    p.add_argument("--q-heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    splits = _ints(args.splits)
    print(f"microseconds a layer, {args.layers} distinct caches a replay")
    print("| B x L | block_n x warps | rule's splits | "
          + " | ".join(f"{s} splits" for s in splits) + " |")
    print("|---" * (len(splits) + 3) + "|")
    for cfg in args.configs.split(","):
        B, L = (int(x) for x in cfg.split("x"))
        cases = [make_case([L] * B, args.q_heads, args.kv_heads, args.head_dim, 16,
                           torch.bfloat16, device="cuda", seed=i, poison=0.0)
                 for i in range(args.layers)]
        refs = [triton_decode.paged_decode_attention(*c.args(), max_len=L, num_splits=1)
                for c in cases]
        rule = triton_decode.choose_splits(B * args.kv_heads, L, num_sms(cases[0].q.device))
        for block_n in _ints(args.block_n):
            for warps in _ints(args.warps):
                cells = [_cell(cases, refs, L, s, block_n, warps) for s in splits]
                print(f"| {B} x {L} | {block_n} x {warps} | {rule} | " + " | ".join(cells) + " |")
        del cases, refs
        torch.cuda.empty_cache()


def _cell(cases: list, refs: list, L: int, splits: int, block_n: int, warps: int) -> str:
    def run():
        return [triton_decode.paged_decode_attention(*c.args(), max_len=L, num_splits=splits,
                                                     block_n=block_n, num_warps=warps)
                for c in cases]
    try:
        outs = run()
    except Exception as e:  # a tile this GPU cannot hold: say so, sweep on
        return f"({type(e).__name__})"
    err = max(float((o.float() - r.float()).norm() / r.float().norm())
              for o, r in zip(outs, refs))
    us = do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3 / len(cases)
    return f"{us:.1f}" + ("" if err < 1e-2 else " (err)")


if __name__ == "__main__":
    main()
