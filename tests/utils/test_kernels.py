"""minisparse.utils.kernels.triton_module: the one way CPU-safe modules reach their Triton
kernels (a module for CUDA tensors, None for other devices or a module that cannot load)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minisparse.utils.kernels import triton_module

CUDA_TENSOR = SimpleNamespace(is_cuda=True)  # what the loader reads of a CUDA tensor


def test_cpu_tensors_get_no_kernels_even_where_the_module_loads():
    assert triton_module("minisparse.compression.trigger", torch.zeros(1)) is None


def test_cuda_tensors_get_the_module_once_imported():
    import minisparse.compression.trigger as module

    assert triton_module("minisparse.compression.trigger", CUDA_TENSOR) is module


def test_a_module_that_cannot_load_means_the_pytorch_path():
    assert triton_module("minisparse.no_such_kernels", CUDA_TENSOR) is None


# Compaction kernels take a new longest cache (LMAX) and index tensors at any offset in
# every event; specialized on them, Triton compiled anew (1-3 s) whenever an event met a
# new class of value (a multiple of 16 or not, an odd or even count of sequences).
PER_EVENT = {"LMAX": "do_not_specialize",
             "ROWS": "do_not_specialize_on_alignment", "LENS": "do_not_specialize_on_alignment",
             "FIRST": "do_not_specialize_on_alignment",
             "NEXT": "do_not_specialize_on_alignment"}


def test_compaction_kernels_compile_once_for_any_event():
    pytest.importorskip("triton")
    import importlib

    from triton.runtime.jit import KernelInterface

    checked = 0
    for name in ("minisparse.engine.triton_compaction", "minisparse.engine.triton_scores",
                 "minisparse.compression.triton_redundancy"):
        kernels = [k for k in vars(importlib.import_module(name)).values()
                   if isinstance(k, KernelInterface) and k.fn.__name__.endswith("_kernel")]
        assert kernels, name
        for kernel in kernels:
            for arg in kernel.arg_names:
                if arg in PER_EVENT:
                    assert arg in _unspecialized(kernel, PER_EVENT[arg]), (kernel.fn, arg)
                    checked += 1
    assert checked == 15  # every such argument of the six kernels


def _unspecialized(kernel, option: str) -> set[str]:
    """The arguments a kernel's @triton.jit(option=...) names: compiled (JITFunction) or
    under the interpreter, which other tests switch these modules to."""
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if getattr(p, option)}
    given = kernel.kwargs.get(option) or ()
    return {kernel.arg_names[a] if isinstance(a, int) else a for a in given}
