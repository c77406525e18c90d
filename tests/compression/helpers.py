"""Random inputs shaped like one layer's cache, and the example rule of
docs/compression.md, shared by the compression tests."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from minisparse.compression import ScoringRule, build_rule
from minisparse.config.schema import CompressConfig


def make_inputs(h_kv: int, group: int, length: int, window: int, dim: int = 16,
                seed: int = 0, dtype: torch.dtype = torch.float32):
    """keys [H_kv, L, D], queries [H_q, W, D].

    Keys share a per-head direction of random strength plus a few repeated tokens, so
    cosine similarities spread across R-KV's 0.5 threshold instead of sitting near 0
    (as they do for independent Gaussian keys), and the duplicate rule is exercised.
    """
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(h_kv, 1, dim, generator=gen)
    strength = torch.rand(h_kv, length, 1, generator=gen) * 1.5
    keys = strength * common + torch.randn(h_kv, length, dim, generator=gen)
    repeats = torch.randint(0, length, (length // 8, 2), generator=gen)
    keys[:, repeats[:, 1]] = keys[:, repeats[:, 0]] + 0.05 * torch.randn(
        h_kv, len(repeats), dim, generator=gen)
    queries = 2.0 * torch.randn(h_kv * group, window, dim, generator=gen)
    return keys.to(dtype), queries.to(dtype)


def make_rule(algorithm: str, **settings) -> ScoringRule:
    """The rule of that name, built from a CompressConfig with these settings."""
    return build_rule(CompressConfig(algorithm=algorithm, **settings))


DOC = Path(__file__).resolve().parents[2] / "docs" / "compression.md"


def doc_rule_module() -> str:
    """The text of `my_rules.py` as docs/compression.md prints it ("Write your own rule",
    its first Python block)."""
    text = DOC.read_text().split("## Write your own rule", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)
