"""How the CPU-safe modules reach their Triton kernels (engine layers, compaction, R-KV's
redundancy scoring): each kernel module sits beside the PyTorch path it replaces on CUDA
and is imported only on the first CUDA call, so CPU runs never depend on Triton and the
interpreter switch (TRITON_INTERPRET, read when kernels are decorated) is decided by
whoever imports it first."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch


def triton_module(name: str, x: torch.Tensor) -> ModuleType | None:
    """The Triton kernel module `name` (a dotted module path) for CUDA tensors x; None for
    other devices, or when Triton cannot be imported or finds no working GPU driver."""
    return _import(name) if x.is_cuda else None


@functools.cache
def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except (ImportError, RuntimeError):  # no Triton, or no driver it can use
        return None
