"""Advantages, by loss.advantage (slime's --advantage-estimator names):

- grpo, gspo: each response against the other responses to its prompt,
  (R - group mean) / (group std + eps) (GRPO, arXiv 2402.03300; GSPO, arXiv 2507.18071,
  uses the same advantage and changes the importance ratio, see grpo/loss.py);
- reinforce_plus_plus: the outcome reward whitened over the whole rollout batch
  (REINFORCE++, arXiv 2501.03262), no per-prompt baseline;
- reinforce_plus_plus_baseline: the group mean subtracted first, then whitened over the
  batch (REINFORCE++-baseline, same paper).

A group whose rewards are all equal (all right or all wrong) gives every member a zero
advantage under grpo, gspo and the baseline variant, so it adds no policy-gradient
signal; we count such groups because a rising count means the batch is too easy or too
hard for the current policy.
"""

from __future__ import annotations

import torch

from minisparse.config.schema import LossConfig
from minisparse.grpo import Reduce, alone
from minisparse.utils.distributed import Sum


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """(advantage per sample, stats) for rewards laid out prompt-major in groups.

    advantage = (reward - group mean) / (group std + eps); with normalize_std=False the
    division is skipped (Dr.GRPO). The std is the unbiased one (torch default), as in
    the GRPO reference implementations.
    """
    groups = _groups(rewards, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    adv = centered.view(-1)
    return adv, advantage_stats(adv, groups)


def batch_whiten(values: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-6,
                 reduce: Reduce = alone) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and (population) std over every response token
    of the rollout batch on all ranks (summed by `reduce`): a sample counts once per
    token, as REINFORCE++ whitens its per-token advantages."""
    x, n = values.double(), lengths.double()
    sums = reduce(torch.stack([(n * x).sum(), (n * x * x).sum(), n.sum()]))
    count = sums[2].clamp(min=1)
    mean = sums[0] / count
    std = (sums[1] / count - mean * mean).clamp(min=0).sqrt()
    return ((x - mean) / (std + eps)).float()


def compute_advantages(
    rewards: torch.Tensor, group_size: int, lengths: torch.Tensor, cfg: LossConfig,
    reduce: Reduce = alone,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(advantage per sample, stats) by cfg.advantage; lengths are the responses' token
    counts (the batch whitening of the REINFORCE++ variants weighs by them, over the
    ranks that `reduce` sums)."""
    if cfg.advantage in ("grpo", "gspo"):
        return group_advantages(rewards, group_size, cfg.normalize_advantage_std)
    groups = _groups(rewards, group_size)
    if cfg.advantage == "reinforce_plus_plus":
        adv = batch_whiten(groups.view(-1), lengths, reduce=reduce)
    elif cfg.advantage == "reinforce_plus_plus_baseline":
        adv = batch_whiten((groups - groups.mean(dim=1, keepdim=True)).view(-1), lengths,
                           reduce=reduce)
    else:
        raise ValueError(f"unknown advantage estimator {cfg.advantage!r}")
    return adv, advantage_stats(adv, groups)


def advantage_stats(adv: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    zero_signal = groups.max(dim=1).values == groups.min(dim=1).values
    return {
        "advantage/mean": adv.mean().item(),
        "advantage/std": adv.std().item() if adv.numel() > 1 else 0.0,
        "advantage/abs_mean": adv.abs().mean().item(),
        "advantage/max": adv.max().item(),
        "advantage/min": adv.min().item(),
        "advantage/zero_signal_groups": Sum(zero_signal.sum().item()),
        "advantage/zero_signal_frac": zero_signal.float().mean().item(),
    }
