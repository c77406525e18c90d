"""From the grader's scores to the rewards the advantages see: DAPO's soft overlong
punishment (arXiv 2503.14476) when reward.overlong_buffer is set, else the scores as they
are. Grading itself (the math grader or the user's reward.function) is not the
algorithm's: minisparse/rollout.py grades and hands the scores here.
"""

from __future__ import annotations

import torch

from minisparse.config.schema import RewardConfig
from minisparse.grpo.batch import RolloutBatch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, as a positive amount to subtract: 0 up to
    max_len - buffer tokens, then rising linearly to `penalty` at max_len, so a response
    is told to finish before it is cut off rather than only when it is."""
    over = (lengths.float() - (max_len - buffer)).clamp(min=0) / max(buffer, 1)
    return penalty * over.clamp(max=1.0)


def set_rewards(batch: RolloutBatch, scores: list[float], stats: dict, cfg: RewardConfig,
                max_response_len: int | None = None) -> dict:
    """Fill batch.scores (the grades), batch.rewards (the grades less the overlong penalty
    when cfg.overlong_buffer is set, which needs max_response_len) and batch.grade_stats
    (the grader's stats, with the penalty's mean and share); return the stats."""
    batch.scores = torch.tensor(scores, dtype=torch.float32)
    batch.rewards = batch.scores.clone()
    batch.grade_stats = dict(stats)
    if cfg.overlong_buffer:
        if max_response_len is None:
            raise ValueError("reward.overlong_buffer is set: the rewards need max_response_len")
        lengths = torch.tensor([len(r) for r in batch.responses])
        penalty = overlong_penalty(lengths, max_response_len, cfg.overlong_buffer,
                                   cfg.overlong_penalty)
        batch.rewards -= penalty
        batch.grade_stats["overlong_penalty_mean"] = penalty.mean().item()
        batch.grade_stats["overlong_penalized_frac"] = (penalty > 0).float().mean().item()
    return batch.grade_stats
