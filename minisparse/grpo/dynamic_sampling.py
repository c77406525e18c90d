"""Dynamic sampling (DAPO, arXiv 2503.14476): draw more prompts until the rollout batch
holds only groups whose rewards are not all equal.

A group that is all right or all wrong has zero advantage under grpo/gspo, so it only
dilutes the update; with a weak policy on hard data most groups are like that. Each
round draws one more batch of prompts on every rank, generates and grades it, and keeps
the groups with signal. Rounds are collective: all ranks draw in lockstep (so their
prompt samplers stay at the same position and a checkpoint resumes them all) until
every rank holds its share, or dynamic_sampling_max_rounds is reached; then a rank still
short fills its batch with zero-signal groups, so every rank ends with exactly
rollout_batch_size / world prompts x n_samples_per_prompt samples, as the update's
shape requires.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisparse.grpo import Reduce, alone
from minisparse.grpo.batch import RolloutBatch, take_samples
from minisparse.utils.distributed import Max, Sum


def signal_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: the group's rewards are not all equal."""
    groups = rewards.view(-1, group_size)
    return groups.max(dim=1).values != groups.min(dim=1).values


def sample_with_signal(
    draw: Callable[[int], RolloutBatch],
    score: Callable[[RolloutBatch], dict],
    group_size: int,
    groups_needed: int,
    max_rounds: int,
    reduce: Reduce = alone,
) -> tuple[RolloutBatch, dict[str, float]]:
    """(this rank's batch of groups_needed groups, metrics). draw(round) generates one
    round's batch (prompt-major groups), score(batch) fills its rewards; `reduce` (its
    max over the ranks) keeps every rank drawing while any one is short."""
    rounds: list[RolloutBatch] = []
    signal_picks: list[list[tuple[int, int]]] = []  # per group: (round, sample) pairs
    flat_picks: list[list[tuple[int, int]]] = []
    while True:
        batch = draw(len(rounds))
        score(batch)
        r = len(rounds)
        rounds.append(batch)
        for g, has_signal in enumerate(signal_groups(batch.rewards, group_size).tolist()):
            members = [(r, g * group_size + k) for k in range(group_size)]
            (signal_picks if has_signal else flat_picks).append(members)
        short = max(groups_needed - len(signal_picks), 0)
        any_short = reduce(torch.tensor([short], dtype=torch.int64), "max").item()
        if not any_short or len(rounds) >= max_rounds:
            break
    kept = (signal_picks + flat_picks)[:groups_needed]
    out = take_samples(rounds, [pick for group in kept for pick in group])
    out.grade_stats = _merged_stats([b.grade_stats or {} for b in rounds],
                                    [len(b) for b in rounds])
    drawn = sum(len(b) for b in rounds) // group_size
    metrics = {
        "dynamic_sampling/rounds": Max(float(len(rounds))),
        "dynamic_sampling/drawn_groups": Sum(float(drawn)),
        "dynamic_sampling/zero_signal_groups": Sum(float(len(flat_picks))),
        "dynamic_sampling/surplus_groups": Sum(float(max(len(signal_picks) - groups_needed, 0))),
        "dynamic_sampling/filled_groups": Sum(float(short)),
        "dynamic_sampling/drawn_reward_mean": torch.cat([b.rewards for b in rounds]).mean().item(),
    }
    return out, metrics


def _merged_stats(stats: list[dict], counts: list[int]) -> dict[str, float]:
    """The grader's stats over all rounds: per-sample shares and means (accuracy, *_mean,
    *_frac) weighted by samples, counts and times summed."""
    total = max(sum(counts), 1)
    merged: dict[str, float] = {}
    for part, n in zip(stats, counts):
        for key, value in part.items():
            per_sample = key == "accuracy" or key.endswith(("_mean", "_frac"))
            value = value * n / total if per_sample else value
            merged[key] = merged.get(key, 0.0) + value
    return merged
