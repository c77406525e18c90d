"""Selection policies: which cached tokens each layer keeps when a sequence's KV cache is
compressed. SnapKV keeps the tokens the recent queries attend to; RKV (R-KV) also
penalises tokens whose keys duplicate others'. Both keep the last `window` tokens.

select() serves one sequence in one layer; select_batch() serves many rows (sequences x
layers folded together) at once, in chunks of rows sized so the scratch memory (R-KV's
L x L similarity matrix above all) stays under a cap.
"""
from __future__ import annotations

import torch

from minisparse.config.schema import CompressConfig

from .scoring import attention_importance, position_mask, redundancy, uses_triton

DEFAULT_CHUNK_BYTES = 1 << 30


class SnapKV:
    """Keep the tokens the last `window` queries attend to most, plus those queries' own.

    Its settings are a CompressConfig's (budget, window, kernel_size, pooling,
    group_pooling, selection), checked where the config is loaded (validate_config).
    chunk_bytes caps select_batch's scratch memory; it is the device's limit, not a setting.
    """

    def __init__(self, cfg: CompressConfig, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        _check(chunk_bytes > 0, "chunk_bytes", f"must be > 0, got {chunk_bytes}")
        self.cfg = cfg
        self.chunk_bytes = chunk_bytes

    # The engine sizes its KV pool and its compactions by these two.
    @property
    def budget(self) -> int:
        return self.cfg.budget

    @property
    def window(self) -> int:
        return self.cfg.window

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    # ---- public API -------------------------------------------------------------------

    def select(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """Kept positions of one sequence in one layer: LongTensor [H_kv, min(L, budget)].

        keys [H_kv, L, D] (post-RoPE, newest last), queries [H_q, W, D] (the last W
        positions' post-RoPE queries). Ascending per head; all L positions when L <= budget.
        """
        self._check_single(keys, queries)
        h_kv, length = keys.shape[0], keys.shape[1]
        if length <= self.budget:
            return torch.arange(length, device=keys.device).expand(h_kv, length).contiguous()
        lengths = torch.tensor([length], device=keys.device)
        return self._select_rows(keys.unsqueeze(0), queries.unsqueeze(0), lengths)[0]

    def score(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """The scores select() ranks the L - W older tokens by: [H_kv, L - W], float32
        (float64 for float64 inputs), before "per_layer" sums them over heads.
        For diagnostics and tests (judging selections where scores tie)."""
        self._check_single(keys, queries)
        length = keys.shape[1]
        _check(length > self.window, "keys", f"need more than window={self.window} tokens")
        lengths = torch.tensor([length], device=keys.device)
        scores = self._scores(keys.unsqueeze(0), queries.unsqueeze(0), lengths)
        return scores[0, :, : length - self.window]

    def select_batch(
        self,
        keys: torch.Tensor,
        queries: torch.Tensor,
        lengths: torch.Tensor,
        chunk_bytes: int | None = None,
    ) -> torch.Tensor:
        """Kept positions of many rows: LongTensor [B, H_kv, budget], ascending per row.

        keys [B, H_kv, Lmax, D] padded past lengths[b], queries [B, H_q, W, D], lengths [B]
        with budget < lengths[b] <= Lmax. Row b equals select(keys[b, :, :lengths[b]],
        queries[b]). chunk_bytes overrides the policy's scratch-memory cap for this call.
        """
        _check(keys.dim() == 4, "keys",
               f"must be [B, H_kv, Lmax, D], got shape {tuple(keys.shape)}")
        _check(queries.dim() == 4, "queries",
               f"must be [B, H_q, W, D], got shape {tuple(queries.shape)}")
        self._check_shapes(keys, queries)
        _check(lengths.shape == (keys.shape[0],), "lengths",
               f"must have shape ({keys.shape[0]},), got {tuple(lengths.shape)}")
        _check(not lengths.is_floating_point(), "lengths", "must be an integer tensor")
        if keys.shape[0] == 0:
            return torch.empty(0, keys.shape[1], self.budget, dtype=torch.long,
                               device=keys.device)
        lo, hi = int(lengths.min()), int(lengths.max())
        _check(lo > self.budget, "lengths", f"must all exceed budget={self.budget}, min {lo}")
        _check(hi <= keys.shape[2], "lengths", f"must be <= Lmax={keys.shape[2]}, max {hi}")
        lengths = lengths.to(device=keys.device, dtype=torch.long)
        step = self.rows_per_chunk(keys, queries, chunk_bytes)
        parts = [
            self._select_rows(keys[i:i + step], queries[i:i + step], lengths[i:i + step])
            for i in range(0, keys.shape[0], step)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rows_per_chunk(
        self, keys: torch.Tensor, queries: torch.Tensor, chunk_bytes: int | None = None
    ) -> int:
        """How many rows one chunk of select_batch processes under the memory cap."""
        cap = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        return max(1, cap // self._scratch_bytes_per_row(keys, queries))

    # ---- internals --------------------------------------------------------------------

    def _scores(
        self, keys: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Eviction scores [B, H_kv, Lmax] (higher = keep); only positions < N_b are used."""
        c = self.cfg
        return attention_importance(keys, queries, lengths, c.kernel_size, c.pooling,
                                    c.group_pooling)

    def _select_rows(
        self, keys: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Top budget - W older tokens by score plus the last W tokens, sorted."""
        rows, h_kv, lmax, _ = keys.shape
        scores = self._scores(keys, queries, lengths)
        older = position_mask(lengths - self.window, lmax)[:, None, :]
        scores = scores.masked_fill(~older, float("-inf"))
        if self.cfg.selection == "per_layer":
            scores = scores.sum(dim=1, keepdim=True)
        top = scores.topk(self.budget - self.window, dim=-1).indices.expand(rows, h_kv, -1)
        recent = torch.arange(self.window, device=keys.device) - self.window
        recent = (lengths[:, None] + recent).unsqueeze(1).expand(rows, h_kv, -1)
        return torch.cat([top, recent], dim=-1).sort(dim=-1).values

    def _scratch_bytes_per_row(self, keys: torch.Tensor, queries: torch.Tensor) -> int:
        """Peak temporary bytes of one row: the float32 logits of all query heads, then
        pooled over each group (masked, softmaxed: up to three live at once), and off CUDA
        a float32 copy of the keys for the product (on CUDA it runs in the input dtype
        with a float32 result). An estimate that is several times the real peak makes
        chunks, and their launches and syncs, several times too many."""
        h_kv, lmax, dim = keys.shape[1], keys.shape[2], keys.shape[3]
        h_q, window = queries.shape[1], queries.shape[2]
        upcast = 0 if keys.is_cuda else h_kv * lmax * dim
        return 4 * (upcast + (h_q + 3 * h_kv) * window * lmax) + 1

    def _check_single(self, keys: torch.Tensor, queries: torch.Tensor) -> None:
        """One row's shapes: keys [H_kv, L, D], queries [H_q, W, D]."""
        _check(keys.dim() == 3, "keys", f"must be [H_kv, L, D], got shape {tuple(keys.shape)}")
        _check(queries.dim() == 3, "queries",
               f"must be [H_q, W, D], got shape {tuple(queries.shape)}")
        self._check_shapes(keys.unsqueeze(0), queries.unsqueeze(0))

    def _check_shapes(self, keys: torch.Tensor, queries: torch.Tensor) -> None:
        """Batched shapes: keys [B, H_kv, L, D], queries [B, H_q, W, D]."""
        (rows, h_kv, _, dim), (q_rows, h_q, window, q_dim) = keys.shape, queries.shape
        _check(q_rows == rows, "queries", f"batch {q_rows} != keys batch {rows}")
        _check(q_dim == dim, "queries", f"head dim {q_dim} != keys head dim {dim}")
        _check(window == self.window, "queries",
               f"hold {window} positions, the policy's window is {self.window}")
        _check(h_kv >= 1 and h_q % h_kv == 0, "queries",
               f"query heads {h_q} must be a multiple of KV heads {h_kv}")
        _check(keys.dtype == queries.dtype, "queries",
               f"dtype {queries.dtype} != keys dtype {keys.dtype}")
        _check(keys.device == queries.device, "queries",
               f"device {queries.device} != keys device {keys.device}")


class RKV(SnapKV):
    """R-KV: SnapKV's attention importance mixed with a penalty for redundant keys
    (a CompressConfig's mix_lambda and sim_threshold besides SnapKV's settings)."""

    def _scores(
        self, keys: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """lambda * importance - (1 - lambda) * redundancy."""
        importance = super()._scores(keys, queries, lengths)
        penalty = redundancy(keys, lengths, self.cfg.sim_threshold)
        mix = self.cfg.mix_lambda
        return mix * importance - (1.0 - mix) * penalty

    def _scratch_bytes_per_row(self, keys: torch.Tensor, queries: torch.Tensor) -> int:
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
        return super()._scratch_bytes_per_row(keys, queries) + extra


POLICIES = {"snapkv": SnapKV, "rkv": RKV}  # by compress.algorithm, besides "none"


def build_policy(cfg: CompressConfig) -> RKV | SnapKV | None:
    """The policy a config asks for; None when algorithm is "none" (dense rollouts)."""
    return None if cfg.algorithm == "none" else POLICIES[cfg.algorithm](cfg)


def _check(ok: bool, name: str, message: str) -> None:
    """Raise ValueError naming the offending parameter."""
    if not ok:
        raise ValueError(f"{name}: {message}")
