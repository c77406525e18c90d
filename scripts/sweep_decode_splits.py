"""Decode attention time (CUDA-graph replays) against its split count, at the cache
lengths rollouts of the 1.5B hold (--configs BxL), for each --splits value: whether the
split rule (triton_decode.choose_splits) fits short caches.

    python -m scripts.sweep_decode_splits --q-heads 12 --kv-heads 2 \
        --configs 16x224,16x768,64x224,64x768,256x224,256x768 --splits 1,2,3,4,6,8,12,16
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

from minisparse.bench.decode import make_case
from minisparse.engine.layers import triton_decode
from minisparse.engine.layers.fused_ops import num_sms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="16x224,16x768,64x224,64x768,256x224,256x768")
    p.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    p.add_argument("--q-heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    splits = [int(s) for s in args.splits.split(",")]
    print("| B x L | rule's splits | " + " | ".join(f"{s} splits" for s in splits) + " |")
    print("|---" * (len(splits) + 2) + "|")
    for cfg in args.configs.split(","):
        B, L = (int(x) for x in cfg.split("x"))
        c = make_case([L] * B, args.q_heads, args.kv_heads, args.head_dim, 16, torch.bfloat16,
                      device="cuda", poison=0.0)
        ref = triton_decode.paged_decode_attention(*c.args(), max_len=L, num_splits=1)
        cells = []
        for s in splits:
            run = lambda: triton_decode.paged_decode_attention(*c.args(), max_len=L,  # noqa
                                                              num_splits=s)
            err = float((run().float() - ref.float()).norm() / ref.float().norm())
            us = do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3
            cells.append(f"{us:.1f}" + ("" if err < 1e-2 else " (err)"))
        rule = triton_decode.choose_splits(B * args.kv_heads, L, num_sms(c.q.device))
        print(f"| {B} x {L} | {rule} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
