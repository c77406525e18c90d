"""Sparse-RL corrections for the gap between the compressed sampler and the dense policy.

The rollout engine samples with a compressed KV cache, so its token probabilities
(logp_rollout) differ from those of the dense policy that is trained (logp_old). Three
corrections, each switchable for ablations (cfg.loss.*):

- importance weights (use_tis): exp(delta), delta = logp_old - logp_rollout, per token,
  per sequence (sum of delta) or geometric (mean of delta), bounded by truncation
  (min(w, upper)), clipping ([lower, upper]) or masking (0 outside [lower, upper]);
- rejection (use_rs): tokens whose ratio at rs_level (token, sequence or geometric; by
  default tis_level) lies outside [rs_lower, rs_upper] leave the loss (at sequence or
  geometric level the whole sequence: its product of ratios, or their geometric mean,
  decides), and a sequence holding any token with exp(delta) < rs_veto_threshold leaves it
  entirely (the sparsity-aware veto: compression produced a token the dense policy
  would almost never emit); rs_veto_threshold <= 0 turns the veto off;
- batch normalisation (normalize_weights): weights divided by their mean over the kept
  tokens of the whole rollout batch (all-reduced over ranks), so they average 1 and the
  update size does not drift with the mismatch.

Everything is computed once per rollout over the whole batch, detached, and then carried
per token into the micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisparse.config.schema import LossConfig
from minisparse.grpo import Reduce, alone
from minisparse.utils.distributed import Max, Sum

LOG_RATIO_CLAMP = 20.0


@dataclass
class Corrections:
    weights: torch.Tensor  # [N, T] float, 0 on padding; multiplies the policy term
    keep: torch.Tensor  # [N, T] bool, tokens that stay in the loss
    vetoed: torch.Tensor  # [N] bool, sequences removed by the veto
    metrics: dict[str, float]


def log_ratio(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """delta = logp_old - logp_rollout per token, clamped to [-20, 20], 0 on padding."""
    delta = (old_logp - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask, delta, torch.zeros_like(delta))


def level_log_ratio(delta: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Log importance ratio at the given level, broadcast to every token of its row."""
    if level == "token":
        return delta
    total = delta.sum(dim=1, keepdim=True)
    if level == "sequence":
        seq = total
    elif level == "geometric":
        seq = total / mask.sum(dim=1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"unknown importance level {level!r}")
    seq = seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask, seq.expand_as(delta), torch.zeros_like(delta))


def bound_weights(raw: torch.Tensor, mode: str, lower: float, upper: float) -> torch.Tensor:
    """truncate: min(w, upper); clip: w clamped to [lower, upper]; mask: 0 outside."""
    if mode == "truncate":
        return raw.clamp(max=upper)
    if mode == "clip":
        return raw.clamp(min=lower, max=upper)
    if mode == "mask":
        inside = (raw >= lower) & (raw <= upper)
        return torch.where(inside, raw, torch.zeros_like(raw))
    raise ValueError(f"unknown importance mode {mode!r}")


def rejection(
    delta: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    lower: float,
    upper: float,
    veto_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kept tokens [N,T], rejected-by-bounds tokens [N,T], vetoed sequences [N])."""
    ratio = level_log_ratio(delta, mask, level).exp()
    rejected = mask & ((ratio < lower) | (ratio > upper))
    if veto_threshold > 0:
        # A token's own ratio decides the veto, whatever the importance level.
        vetoed = (mask & (delta.exp() < veto_threshold)).any(dim=1)
    else:
        vetoed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    keep = mask & ~rejected & ~vetoed[:, None]
    return keep, rejected, vetoed


def _whole_rows(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows with tokens, every one of them flagged."""
    return mask.any(dim=1) & (flags | ~mask).all(dim=1)


def batch_mean(values: torch.Tensor, mask: torch.Tensor, reduce: Reduce = alone) -> torch.Tensor:
    """Mean of values over mask on all ranks (their sums and counts added by `reduce`)."""
    stats = reduce(torch.stack([(values * mask).sum(), mask.sum()]).double())
    return (stats[0] / stats[1].clamp(min=1)).to(values.dtype)


def compute_corrections(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
    reduce: Reduce = alone,
) -> Corrections:
    """Weights and kept-token mask for a whole rollout batch ([N, T] padded tensors); the
    weights' normalisation averages over the ranks that `reduce` sums."""
    mask = mask.bool()
    delta = log_ratio(old_logp.float(), rollout_logp.float(), mask)
    raw = torch.where(mask, level_log_ratio(delta, mask, cfg.tis_level).exp(), 0.0)
    n_tokens = mask.sum().clamp(min=1)
    metrics = {
        "tis/raw_mean": (raw.sum() / n_tokens).item(),
        "tis/raw_max": Max(raw[mask].max().item() if mask.any() else 0.0),
        "tis/raw_min": raw[mask].min().item() if mask.any() else 0.0,
    }
    if cfg.use_tis:
        weights = bound_weights(raw, cfg.tis_mode, cfg.tis_lower, cfg.tis_upper)
        weights = torch.where(mask, weights, 0.0)
    else:
        weights = mask.float()
    metrics["tis/truncated_frac"] = (
        ((weights != raw) & mask).sum().item() / n_tokens.item() if cfg.use_tis else 0.0
    )
    metrics["tis/bounded_mean"] = (weights.sum() / n_tokens).item()

    if cfg.use_rs:
        lower, upper = cfg.rs_bounds()
        keep, rejected, vetoed = rejection(
            delta, mask, cfg.rejection_level(), lower, upper, cfg.rs_veto_threshold
        )
    else:
        keep, rejected = mask, torch.zeros_like(mask)
        vetoed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    weights = torch.where(keep, weights, 0.0)
    if cfg.normalize_weights:
        weights = weights / batch_mean(weights, keep, reduce).clamp(min=1e-8)
    metrics.update(
        {
            "tis/final_mean": (weights.sum() / keep.sum().clamp(min=1)).item(),
            "tis/final_max": Max(weights.max().item() if weights.numel() else 0.0),
            "rs/rejected_token_frac": rejected.sum().item() / n_tokens.item(),
            "rs/kept_token_frac": keep.sum().item() / n_tokens.item(),
            "rs/rejected_seq_frac": _whole_rows(rejected, mask).float().mean().item()
            if mask.shape[0] else 0.0,
            "rs/vetoed_seqs": Sum(vetoed.sum().item()),
            "rs/vetoed_frac": vetoed.float().mean().item() if vetoed.numel() else 0.0,
        }
    )
    return Corrections(weights.detach(), keep, vetoed, metrics)
