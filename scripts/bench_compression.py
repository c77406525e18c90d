"""Time one compression event (select_batch over every sequence x layer) against a decode
step of a model of the same shape, to see what sparse rollouts pay for selection.

    python scripts/bench_compression.py                  # Qwen2.5-3B shapes, bf16, CUDA
    python scripts/bench_compression.py --device cpu --seqs 4 --layers 2 --length 80 \
        --budget 64 --head-dim 32 --repeats 2            # smoke run

The event covers scoring and top-k only; gathering the kept K/V into place is the
engine's part. "per token" amortises one event over --divide-length decode steps (the
step_length trigger compresses each sequence once per divide_length tokens).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minisparse.compression import RKV, SnapKV  # noqa: E402
from minisparse.config import Selection, choices  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="decode proxy: model width")
    p.add_argument("--ffn", type=int, default=11008, help="decode proxy: MLP width")
    p.add_argument("--vocab", type=int, default=151936, help="decode proxy: lm_head rows")
    p.add_argument("--length", type=int, default=640, help="cache length at the event")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--divide-length", type=int, default=128)
    p.add_argument("--selection", default="per_head", choices=choices(Selection))
    p.add_argument("--chunk-mb", type=int, default=None, help="select_batch memory cap")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args()


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int,
              repeats: int) -> float:
    """Median wall time of fn in ms; CUDA events on GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_step_proxy(args: argparse.Namespace, device: torch.device,
                      dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One decode step of a dense model of the given shape on random weights: per layer
    QKV/O projections, GQA attention over `length` cached tokens and a SwiGLU MLP, then
    the lm_head. Weights are shared across layers (same FLOPs; the real model streams
    distinct weights, so this is a lower bound on the step time)."""
    b, hd, h_q, h_kv = args.seqs, args.head_dim, args.q_heads, args.kv_heads
    w = {name: torch.randn(shape, device=device, dtype=dtype) * 0.02 for name, shape in {
        "qkv": ((h_q + 2 * h_kv) * hd, args.hidden), "o": (args.hidden, h_q * hd),
        "up": (2 * args.ffn, args.hidden), "down": (args.hidden, args.ffn),
        "head": (args.vocab, args.hidden)}.items()}
    k = torch.randn(b, h_kv, args.length, hd, device=device, dtype=dtype)
    v = torch.randn_like(k)
    x0 = torch.randn(b, args.hidden, device=device, dtype=dtype)

    def step() -> torch.Tensor:
        x = x0
        for _ in range(args.layers):
            q = F.linear(x, w["qkv"])[:, : h_q * hd].view(b, h_q, 1, hd)
            a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + F.linear(a.reshape(b, h_q * hd), w["o"])
            gate, up = F.linear(x, w["up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        return F.linear(x, w["head"])

    return step


def bench_event(policy, args, device, dtype) -> tuple[float, float]:
    """(median ms, peak scratch GiB) of one select_batch over seqs x layers rows."""
    rows = args.seqs * args.layers
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(rows, args.kv_heads, args.length, args.head_dim, device=device,
                       dtype=dtype, generator=gen)
    queries = torch.randn(rows, args.q_heads, args.window, args.head_dim, device=device,
                          dtype=dtype, generator=gen)
    lengths = torch.full((rows,), args.length, device=device)
    chunk = None if args.chunk_mb is None else args.chunk_mb << 20
    run = lambda: policy.select_batch(keys, queries, lengths, chunk_bytes=chunk)  # noqa
    peak = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return median_ms(run, device, args.warmup, args.repeats), peak


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    common = dict(budget=args.budget, window=args.window, selection=args.selection)
    policies = {"rkv": RKV(**common), "snapkv": SnapKV(**common)}
    with torch.inference_mode():
        decode_ms = median_ms(decode_step_proxy(args, device, dtype), device,
                              args.warmup, args.repeats)
        results = {name: bench_event(p, args, device, dtype) for name, p in policies.items()}
    rows = args.seqs * args.layers
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {args.dtype}; one event = {args.seqs} "
          f"seqs x {args.layers} layers = {rows} rows, {args.kv_heads} KV / {args.q_heads} "
          f"q heads, D={args.head_dim}, L={args.length} -> budget {args.budget}, "
          f"W={args.window}, {args.selection}")
    print(f"decode step proxy (batch {args.seqs}, ctx {args.length}): {decode_ms:.2f} ms")
    print(f"{'policy':8} {'ms/event':>10} {'scratch GiB':>12} "
          f"{'ms/token@' + str(args.divide_length):>14} {'% of decode':>12}")
    for pname, (ms, peak) in results.items():
        per_token = ms / args.divide_length
        print(f"{pname:8} {ms:10.2f} {peak:12.2f} {per_token:14.3f} "
              f"{100 * per_token / decode_ms:11.1f}%")


if __name__ == "__main__":
    main()
