"""KNorm (Devoto et al., 2024, arXiv 2406.11430): keep the keys of lowest L2 norm, which
draw the most attention. Rotary embeddings rotate pairs of coordinates, so the norm of a
cached (post-RoPE) key is its pre-RoPE norm. No queries: the engine keeps no query ring."""
from __future__ import annotations

import torch

from minisparse.compression.rule import ScoringRule
from minisparse.compression.scoring import accumulate_dtype


class KNorm(ScoringRule):
    """Score = -||key||_2 per KV head (float32; float64 for float64 keys)."""

    name = "KNorm"
    uses_queries = False

    def score_batch(self, keys: torch.Tensor, queries: None,
                    lengths: torch.Tensor) -> torch.Tensor:
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=accumulate_dtype(keys.dtype))

    def scratch_bytes(self, keys: torch.Tensor, queries: None) -> int:
        """The default's per-token values plus, for half keys, a float32 copy of them
        (the norm accumulates in float32)."""
        upcast = 0
        if keys.dtype != accumulate_dtype(keys.dtype):
            upcast = 4 * keys.shape[1] * keys.shape[2] * keys.shape[3]
        return super().scratch_bytes(keys, queries) + upcast
