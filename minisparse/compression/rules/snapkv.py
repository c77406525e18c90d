"""SnapKV (Li et al., 2024, arXiv 2404.14469): keep the tokens the last `window` queries
attend to most, plus those queries' own."""
from __future__ import annotations

import torch

from minisparse.compression.rule import ScoringRule
from minisparse.compression.scoring import attention_importance


class SnapKV(ScoringRule):
    """Attention importance (CompressConfig's kernel_size, pooling, group_pooling)."""

    name = "SnapKV"

    def score_batch(self, keys: torch.Tensor, queries: torch.Tensor,
                    lengths: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return attention_importance(keys, queries, lengths, c.kernel_size, c.pooling,
                                    c.group_pooling)

    def scratch_bytes(self, keys: torch.Tensor, queries: torch.Tensor) -> int:
        """The float32 logits of all query heads, then pooled over each group (masked,
        softmaxed: up to three live at once), and off CUDA a float32 copy of the keys for
        the product (on CUDA it runs in the input dtype with a float32 result). An
        estimate that is several times the real peak makes chunks, and their launches and
        syncs, several times too many."""
        h_kv, lmax, dim = keys.shape[1], keys.shape[2], keys.shape[3]
        h_q, window = queries.shape[1], queries.shape[2]
        upcast = 0 if keys.is_cuda else h_kv * lmax * dim
        return 4 * (upcast + (h_q + 3 * h_kv) * window * lmax) + 1
