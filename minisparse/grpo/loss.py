"""The GRPO objective on one micro-batch: PPO clip x Sparse-RL weights, KL, entropy.

The importance ratio is per token, except under loss.advantage=gspo: there it is the
sequence's length-normalised ratio exp(mean_t(logp - old_logp)) over its kept tokens,
clipped with gspo_eps_clip(_high), the same value on every token of the sequence (GSPO,
arXiv 2507.18071); its gradient reaches every token through the mean.

Every term is a per-token tensor [N, T] reduced by `aggregate` over the kept tokens
(Corrections.keep). The reduction divides by a count taken over the whole optimizer
step (all its micro-batches, see `step_denominator`), so summing the micro-batch losses
gives exactly the step's mean: gradient accumulation over uneven micro-batches is exact.
"""

from __future__ import annotations

import torch

from minisparse.config.schema import LossConfig


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped mask, ratio) of the PPO clipped surrogate.

    loss = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), r = exp(logp - old_logp);
    advantages broadcast from [N] to [N, T].
    """
    return clipped_surrogate(logp - old_logp, advantages, eps_clip, eps_clip_high)


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped mask, ratio) of max(-A r, -A clip(r, 1 - low, 1 + high))
    for r = exp(log_ratio); high None -> low."""
    high = low if high is None else high
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped, ratio


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """GSPO's log s_i = mean over the kept tokens of (logp - old_logp), on every token of
    the row [N, T] (0 for a row with no kept token)."""
    keep_f = keep.to(logp.dtype)
    total = ((logp - old_logp) * keep_f).sum(dim=1, keepdim=True)
    return (total / keep_f.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(logp)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 with
    log r = logp - ref_logp; low_var_kl is k3 with the log-ratio clamped to [-20, 20]
    and the result to [-10, 10] (verl's variant: bounded when the ratio explodes).
    """
    log_r = logp - ref_logp
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.exp(-log_r) + log_r - 1.0
    if kind == "low_var_kl":
        log_r = log_r.clamp(-20.0, 20.0)
        return (torch.exp(-log_r) + log_r - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl type {kind!r}")


def step_denominator(keep: torch.Tensor, aggregation: str) -> float:
    """What `aggregate` divides by for a step whose kept tokens are `keep` [N, T]:
    the kept tokens (token_mean) or the samples with any kept token (sample_mean)."""
    if aggregation == "token_mean":
        return float(keep.sum().item())
    if aggregation == "sample_mean":
        return float(keep.any(dim=1).sum().item())
    raise ValueError(f"unknown aggregation {aggregation!r}")


def aggregate(
    values: torch.Tensor, keep: torch.Tensor, aggregation: str, denominator: float
) -> torch.Tensor:
    """Sum of per-token (token_mean) or per-sample-mean (sample_mean) values / denominator
    (> 0: the step's kept count over all ranks, divided by the number of ranks)."""
    keep_f = keep.to(values.dtype)
    masked = values * keep_f
    if aggregation == "token_mean":
        total = masked.sum()
    elif aggregation == "sample_mean":
        total = (masked.sum(dim=1) / keep_f.sum(dim=1).clamp(min=1)).sum()
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    return total / denominator


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor,
    cfg: LossConfig,
    denominator: float,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) for one micro-batch; metrics are detached partial means that sum
    to the step mean over micro-batches, like the loss."""
    if cfg.advantage == "gspo":
        pg, clipped, ratio = clipped_surrogate(sequence_log_ratio(logp, old_logp, keep),
                                               advantages, cfg.gspo_eps_clip, cfg.gspo_eps_clip_high)
    else:
        pg, clipped, ratio = ppo_clip_loss(logp, old_logp, advantages, cfg.eps_clip,
                                           cfg.eps_clip_high)
    agg = lambda x: aggregate(x, keep, cfg.aggregation, denominator)
    pg_loss = agg(pg * weights)
    loss = pg_loss
    metrics = {
        "train/pg_loss": pg_loss.detach(),
        "train/clip_frac": agg(clipped.float()).detach(),
        "train/ratio_mean": agg(ratio.detach()),
    }
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = agg(kl_penalty(logp, ref_logp, cfg.kl_type))
        loss = loss + cfg.kl_coef * kl
        metrics["train/kl"] = kl.detach()
    if entropy is not None:
        ent = agg(entropy)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
        metrics["train/entropy"] = ent.detach()
    metrics["train/loss"] = loss.detach()
    return loss, metrics
