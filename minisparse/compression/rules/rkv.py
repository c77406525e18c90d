"""R-KV (Cai et al., 2025, arXiv 2505.24133): SnapKV's attention importance mixed with a
penalty for tokens whose keys duplicate others'."""
from __future__ import annotations

import torch

from minisparse.compression.rules.snapkv import SnapKV
from minisparse.compression.scoring import redundancy, uses_triton


class RKV(SnapKV):
    """SnapKV's settings plus a CompressConfig's mix_lambda and sim_threshold."""

    name = "R-KV"

    def score_batch(self, keys: torch.Tensor, queries: torch.Tensor,
                    lengths: torch.Tensor) -> torch.Tensor:
        """lambda * importance - (1 - lambda) * redundancy."""
        importance = super().score_batch(keys, queries, lengths)
        penalty = redundancy(keys, lengths, self.cfg.sim_threshold)
        mix = self.cfg.mix_lambda
        return mix * importance - (1.0 - mix) * penalty

    def scratch_bytes(self, keys: torch.Tensor, queries: torch.Tensor) -> int:
        """Adds R-KV's scratch: with the Triton kernels (CUDA) the unit keys in the input
        dtype and a few float32 / int64 values per token; in the PyTorch path the L x L
        similarity matrix in the input dtype plus its one-byte mask, the reversed unit keys
        in the input dtype, and float32 copies of the keys (up to three live at once in
        the normalisation)."""
        h_kv, lmax, dim = keys.shape[1], keys.shape[2], keys.shape[3]
        if uses_triton(keys):
            extra = h_kv * lmax * (dim * keys.element_size() + 4 + 4 + 8 + 4 + 4)
        else:
            extra = (h_kv * lmax * (lmax + dim) * (keys.element_size() + 1)
                     + 4 * 3 * h_kv * lmax * dim)
        return super().scratch_bytes(keys, queries) + extra
