"""Decode attention time (CUDA-graph replays) against its split count and tiling, at the
cache lengths rollouts of the 1.5B hold (--configs BxL), for each --splits value: whether
the split rule (triton_decode.choose_splits) and the tile (block_n 64, 4 warps) fit.

    python -m scripts.sweep_decode_splits --q-heads 12 --kv-heads 2 \
        --configs 16x224,16x768,64x224,64x768,256x224,256x768 --splits 1,2,3,4,6,8,12,16

Each replay runs the kernel over --layers caches of its own, as a decode step reads one
cache a layer (28 on the 1.5B), and reports the time a layer: a single cache replayed
stays in L2 where it fits (16 x 768 is 12.6 MB, 64 x 768 50 MB), which a step never sees.
--rope times the step's own kernel instead (rope_decode_attention: the new token's RoPE
and cache write fused in), which the engine's decode step runs.
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
    p.add_argument("--rope", action="store_true", help="time rope_decode_attention")
    p.add_argument("--q-heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    splits = _ints(args.splits)
    kernel = "rope_decode_attention" if args.rope else "paged_decode_attention"
    print(f"{kernel}: microseconds a layer, {args.layers} distinct caches a replay")
    print("| B x L | block_n x warps | rule's splits | "
          + " | ".join(f"{s} splits" for s in splits) + " |")
    print("|---" * (len(splits) + 3) + "|")
    for cfg in args.configs.split(","):
        B, L = (int(x) for x in cfg.split("x"))
        cases = [make_case([L] * B, args.q_heads, args.kv_heads, args.head_dim, 16,
                           torch.bfloat16, device="cuda", seed=i, poison=0.0)
                 for i in range(args.layers)]
        attend = _kernel(cases, args.rope)
        refs = attend(max_len=L, num_splits=1)
        rule = triton_decode.choose_splits(B * args.kv_heads, L, num_sms(cases[0].q.device))
        for block_n in _ints(args.block_n):
            for warps in _ints(args.warps):
                cells = [_cell(attend, refs, dict(max_len=L, num_splits=s, block_n=block_n,
                                                  num_warps=warps)) for s in splits]
                print(f"| {B} x {L} | {block_n} x {warps} | {rule} | " + " | ".join(cells) + " |")
        del cases, refs, attend
        torch.cuda.empty_cache()


def _kernel(cases: list, rope: bool):
    """The swept kernel over every case's cache: tiling keywords -> the outputs. With rope,
    rope_decode_attention, whose new token (the same each call) is rotated and written
    first."""
    if rope:
        steps = [_rope_step(c) for c in cases]
        return lambda **tiles: [triton_decode.rope_decode_attention(*s, **tiles) for s in steps]
    return lambda **tiles: [triton_decode.paged_decode_attention(*c.args(), **tiles)
                            for c in cases]


def _cell(attend, refs: list, tiles: dict) -> str:
    def run():
        return attend(**tiles)
    try:
        outs = run()
    except Exception as e:  # a tile this GPU cannot hold: say so, sweep on
        return f"({type(e).__name__})"
    err = max(float((o.float() - r.float()).norm() / r.float().norm())
              for o, r in zip(outs, refs))
    us = do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3 / len(refs)
    return f"{us:.1f}" + ("" if err < 1e-2 else " (err)")


def _rope_step(c) -> tuple:
    """rope_decode_attention's arguments for the case's sequences, the new token each
    one's last entry: a fused q/k/v row, cos/sin at its position and its cache slot."""
    B, h_q, D = c.q.shape
    h_kv = c.k_cache.shape[1]
    g = torch.Generator(device=c.q.device).manual_seed(1)
    qkv = torch.randn(B, (h_q + 2 * h_kv) * D, generator=g, device=c.q.device).to(c.q.dtype)
    pos = (c.cache_lens.long() - 1)[:, None, None].float()
    freq = 10000.0 ** (-torch.arange(D // 2, device=c.q.device) / (D // 2))
    angle = torch.cat([pos * freq, pos * freq], dim=-1)  # [B, 1, D]
    last = c.cache_lens.long() - 1
    slots = c.page_table[c.rows, last // c.page_size] * c.page_size + last % c.page_size
    return (qkv, angle.cos().to(c.q.dtype), angle.sin().to(c.q.dtype), slots, c.k_cache,
            c.v_cache, c.page_table, c.rows, c.cache_lens, c.page_size, c.scale, h_q)


if __name__ == "__main__":
    main()
