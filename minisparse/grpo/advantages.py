"""GRPO advantages: each response is scored against the other responses to its prompt.

A group whose rewards are all equal (all right or all wrong) gives every member a zero
advantage, so it adds no policy-gradient signal; we count such groups because a rising
count means the batch is too easy or too hard for the current policy.
"""

from __future__ import annotations

import torch

from minisparse.grpo.metric import Sum


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """(advantage per sample, stats) for rewards laid out prompt-major in groups.

    advantage = (reward - group mean) / (group std + eps); with normalize_std=False the
    division is skipped (Dr.GRPO). The std is the unbiased one (torch default), as in
    the GRPO reference implementations.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    zero_signal = groups.max(dim=1).values == groups.min(dim=1).values
    adv = centered.view(-1)
    stats = {
        "advantage/mean": adv.mean().item(),
        "advantage/std": adv.std().item() if adv.numel() > 1 else 0.0,
        "advantage/abs_mean": adv.abs().mean().item(),
        "advantage/max": adv.max().item(),
        "advantage/min": adv.min().item(),
        "advantage/zero_signal_groups": Sum(zero_signal.sum().item()),
        "advantage/zero_signal_frac": zero_signal.float().mean().item(),
    }
    return adv, stats
