"""Shared by the memory tests: Qwen2.5-3B's shape, read once per module."""
import pytest

from minisparse.models.loading import shape_config
from minisparse.trainer.memory.estimate import shape_of


@pytest.fixture(scope="module")
def qwen3b():
    return shape_of(shape_config("qwen2.5-3b"))
