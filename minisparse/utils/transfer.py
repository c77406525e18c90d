"""Host values onto the GPU without making the host wait for it.

`torch.tensor(values, device="cuda")` and `t.to("cuda")` from pageable memory block the
host until the GPU has finished everything queued before the copy: a loop that builds
small index tensors between kernels then leaves the GPU idle while the host prepares the
next batch of work. From page-locked memory with non_blocking=True the copy is queued
like a kernel and the host runs ahead (the caching host allocator keeps the page-locked
block until the copy is done).
"""
from __future__ import annotations

import torch


def to_device(values: list | torch.Tensor, device: torch.device,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values (a list, or a CPU tensor) as a tensor on device, queued without a host wait
    on CUDA; on other devices a plain tensor."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
