"""The memory bound of a rollout: how fast decode could go if every step only read, once,
the bytes it cannot avoid (all weights a token's forward touches, plus every running
sequence's K/V) at the device's copy bandwidth.

The bench reports tokens/s against this bound, so a speed figure says how far the engine
is from the hardware rather than from another engine. The bytes come from the real weights
and the real per-step cache lengths the engine recorded (GenerateStats.decode_steps and
decode_kv_tokens); the bandwidth from a device-to-device copy measured in the same process
(bytes read plus bytes written, METHOD's convention). Prefill and compression time are
outside the bound: it is a decode bound.

At a batch of a few hundred the weight GEMMs stop being memory-bound: one step does
2 * batch FLOPs per weight, and past ~200 sequences (an H200's FLOP/byte ratio) their
arithmetic takes longer than reading the weights. `decode_roofline` therefore also reports
a roofline: per step, the longer of the weight read and the GEMM arithmetic at a bf16
matmul throughput measured in the same process, plus the K/V read. That is the bound a
step of sequential kernels can approach; the memory bound alone cannot be reached there.
"""
from __future__ import annotations

import statistics

import torch
from torch import nn

from minisparse.engine.sequence import GenerateStats


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of the parameters one decode step reads: every parameter once, except the
    input embedding table when it is not tied to the LM head (a step reads only B rows of
    it, which is negligible)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    total = 0
    seen: set[int] = set()
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def copy_bandwidth(device: torch.device | str, gib: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written), median of `repeats`
    timed copies of a `gib` GiB random buffer after a warm-up (CUDA only)."""
    device = _cuda(device, "copy_bandwidth")
    n = int(gib * (1 << 30)) // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats)
    del src, dst
    return 2 * n * 4 / seconds


def matmul_throughput(device: torch.device | str, size: int = 8192, repeats: int = 10,
                      dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a square `size` GEMM in `dtype`, median of `repeats` after a warm-up
    (CUDA only): the compute ceiling of the roofline, as this device reaches it."""
    device = _cuda(device, "matmul_throughput")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size ** 3 / median_seconds(lambda: a @ b, repeats)


def _cuda(device: torch.device | str, what: str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{what} needs a CUDA device, got {device}")
    return device


def median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    """Median CUDA-event time of fn() over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def decode_roofline(stats: GenerateStats, weight_bytes: int, weight_itemsize: int,
                    kv_token_bytes: int, bandwidth: float, flops_per_s: float) -> dict:
    """Roofline tokens/s of the recorded decode steps: the weight GEMMs take the longer of
    reading the weights once per step and their arithmetic (2 FLOPs per weight per decoded
    token), then every step reads its K/V. Taking the longer over the whole run rather than
    per step keeps it a bound when batches vary (equal when they do not). Attention
    arithmetic (a few % of the GEMMs' at these lengths) is left out."""
    if bandwidth <= 0 or flops_per_s <= 0:
        raise ValueError(f"bandwidth and flops_per_s must be positive, got {bandwidth}, "
                         f"{flops_per_s}")
    if stats.decode_steps == 0:
        return dict(roofline_tokens_per_s=0.0, roofline_fraction=0.0, gemm_flops_s=0.0)
    read = stats.decode_steps * weight_bytes / bandwidth
    arithmetic = 2 * (weight_bytes / weight_itemsize) * stats.decode_tokens / flops_per_s
    kv_read = stats.decode_kv_tokens * kv_token_bytes / bandwidth
    total = max(read, arithmetic) + kv_read
    tps = stats.decode_tokens / total
    return dict(roofline_tokens_per_s=tps, roofline_fraction=stats.tokens_per_s / tps,
                gemm_flops_s=arithmetic)


def decode_bound(stats: GenerateStats, weight_bytes: int, kv_token_bytes: int,
                 bandwidth: float) -> dict:
    """Bound tokens/s of the decode steps `stats` recorded, and the measured run's share
    of it. Each decode step reads the weights once and every running sequence's cache
    (decode_kv_tokens sums the attended entries over steps); it yields one token per
    sequence, so the bound is decoded tokens over the bound time."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    if stats.decode_steps == 0:
        return dict(bound_tokens_per_s=0.0, bound_fraction=0.0, bound_s=0.0)
    total_bytes = stats.decode_steps * weight_bytes + stats.decode_kv_tokens * kv_token_bytes
    bound_s = total_bytes / bandwidth
    bound_tps = stats.decode_tokens / bound_s
    return dict(bound_tokens_per_s=bound_tps, bound_fraction=stats.tokens_per_s / bound_tps,
                bound_s=bound_s)
