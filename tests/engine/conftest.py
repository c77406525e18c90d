"""Fixtures for the engine tests: the tiny models of engine_helpers, built once per module."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import build

# The tiny models are latency-bound: on a small shared CPU, intra-op threads only spin.
torch.set_num_threads(1)

@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request) -> torch.nn.Module:
    return build(request.param)


@pytest.fixture(scope="module")
def qwen2() -> torch.nn.Module:
    return build("qwen2")
