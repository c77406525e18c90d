"""minisparse.utils.kernels.triton_module: the one way CPU-safe modules reach their Triton
kernels (a module for CUDA tensors, None for other devices or a module that cannot load)."""
from __future__ import annotations

from types import SimpleNamespace

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
