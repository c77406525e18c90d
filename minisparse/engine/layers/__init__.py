"""The engine's layers. `cuda_kernels` is how the CPU-safe modules reach their Triton
kernels."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch


def cuda_kernels(module: str, x: torch.Tensor) -> ModuleType | bool:
    """The Triton kernel module `module` for CUDA tensors x, False for other devices or
    when Triton cannot be imported. Imported on first CUDA use, so CPU runs never depend
    on Triton and the interpreter switch (TRITON_INTERPRET, read when kernels are
    decorated) is decided by whoever imports it first."""
    return _import(module) if x.is_cuda else False


@functools.cache
def _import(module: str) -> ModuleType | bool:
    try:
        return importlib.import_module(module)
    except ImportError:
        return False
