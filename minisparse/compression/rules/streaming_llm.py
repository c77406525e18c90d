"""StreamingLLM (Xiao et al., 2024, arXiv 2309.17453): keep the first `n_sink` tokens
(attention sinks, which soak up attention whatever they hold) and the most recent ones.
Scores are positions alone: no queries, so the engine keeps no query ring for it."""
from __future__ import annotations

import torch

from minisparse.compression.rule import ScoringRule
from minisparse.compression.scoring import accumulate_dtype


class StreamingLLM(ScoringRule):
    """Sinks score above every other token, the earliest highest (so a budget too small
    for all of them keeps the first); the rest score their position, newest highest.
    Reads a CompressConfig's n_sink besides budget and window."""

    name = "StreamingLLM"
    uses_queries = False

    def score_batch(self, keys: torch.Tensor, queries: None,
                    lengths: torch.Tensor) -> torch.Tensor:
        rows, h_kv, lmax, _ = keys.shape
        pos = torch.arange(lmax, device=keys.device, dtype=accumulate_dtype(keys.dtype))
        scores = torch.where(pos < self.cfg.n_sink, 2 * lmax - pos, pos)
        return scores.expand(rows, h_kv, lmax)
