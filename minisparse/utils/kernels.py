"""How the CPU-safe modules reach their Triton kernels (engine layers, compaction, R-KV's
redundancy scoring): each kernel module sits beside the PyTorch path it replaces on CUDA
and is imported only on the first CUDA call, so CPU runs never depend on Triton and the
interpreter switch (TRITON_INTERPRET, read when kernels are decorated) is decided by
whoever imports it first.

Triton compiles a kernel once per specialization of its arguments (whether each integer
is 1 or a multiple of 16, whether each pointer is 16-byte aligned), and a compile takes
1-3 s. Arguments that change class from call to call are left unspecialized: a
compaction's longest cache (LMAX, do_not_specialize) and the index tensors it slices out
of one copy (do_not_specialize_on_alignment). Specialized, the events of a run kept
meeting new classes for several rollouts, and on the 1.5B at 640 entries the compiles
were ~3 s of an 18.6 s rollout whose ~30 events take 0.6 s.
"""
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
