"""torch.distributed helpers that work single-process, with gloo (CPU) and nccl (GPU),
and how a metric combines over ranks.

NCCL only reduces CUDA tensors and gloo only CPU ones; these helpers move the tensor to
the backend's device and back, so callers never branch on the backend.

A metric's reduction over ranks is carried by its value where the metric is made, so
renaming a metric cannot change it: Sum for counts, Max for maxima, a plain float for
metrics averaged over ranks. Both are floats (they log and compare as floats).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def init_distributed() -> torch.device:
    """Start the process group (nccl with GPUs, gloo without) and pick this rank's device.

    Under torchrun the launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT stand.
    Without it (one process, and DeepSpeed still needs an initialised group) the group
    meets in an in-process store instead of on a TCP port, so any number of single-process
    runs share a machine (a fixed default port made the second one fail with EADDRINUSE);
    a MASTER_PORT set by hand is still used.
    """
    single = os.environ.get("WORLD_SIZE", "1") == "1" and "MASTER_PORT" not in os.environ
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # Generous: in-training evaluation gathers each benchmark from all ranks, and
        # the paper's seven benchmarks take hours (eval.limit keeps it short); a rank
        # that finishes its share first waits for the slowest.
        timeout = timedelta(hours=6)
        if single:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group(backend, timeout=timeout)
    return device


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduced copy of tensor over all ranks (sum | max | min); identity single-process."""
    if not is_distributed():
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    work = tensor.detach().to(_comm_device()).clone()
    dist.all_reduce(work, op=ops[op])
    return work.to(tensor.device)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable obj, in rank order; [obj] single-process."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if is_distributed():
        dist.barrier()


class Sum(float):
    """A count: added up over ranks."""


class Max(float):
    """A maximum: the largest value over ranks."""
