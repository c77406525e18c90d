"""What each phase of a rollout costs: its wall time (synchronised with the device, where
work runs after the host has moved on) and the memory it held, as time/* and mem/*
metrics. The loop wraps each phase in `phase`; the update times its optimizer steps with
`timed`.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from minisparse.utils.distributed import Max, rank
from minisparse.utils.heartbeat import heartbeat

GIB = 1024**3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds fn took on the device (synchronised around it on a GPU, where work runs
    after the host has moved on)."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


@contextmanager
def phase(name: str, metrics: dict[str, float], device: torch.device) -> Iterator[None]:
    """Record time/{name}_s and, on GPU, mem/{name}_peak_gib (max allocated in the phase),
    mem/{name}_reserved_gib, mem/{name}_end_gib (allocated when it ends: after a swap,
    what the next phase starts with) and mem/{name}_alloc_retries (times the caching
    allocator had to free its cache and try again: a phase at the GPU's limit, each retry
    a device sync) into metrics; on CPU the process's peak RSS so far. Rank 0 prints a
    heartbeat line while a phase runs long without any other line (output to a file)."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        retries = _alloc_retries(device)
    start = time.perf_counter()
    with heartbeat(name, enabled=rank() == 0):
        yield
    _sync(device)
    metrics[f"time/{name}_s"] = time.perf_counter() - start
    if device.type == "cuda":
        # the largest rank's peak: what a phase needs is what the fullest GPU holds
        metrics[f"mem/{name}_peak_gib"] = Max(torch.cuda.max_memory_allocated(device) / GIB)
        metrics[f"mem/{name}_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        metrics[f"mem/{name}_end_gib"] = torch.cuda.memory_allocated(device) / GIB
        metrics[f"mem/{name}_alloc_retries"] = Max(float(_alloc_retries(device) - retries))
    else:  # process-wide high-water mark (Linux reports KiB); not per phase
        metrics["mem/cpu_max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
