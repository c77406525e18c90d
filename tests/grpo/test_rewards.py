"""The grader's scores into rewards: DAPO's overlong penalty, by hand-computed values."""
import pytest
import torch

from minisparse.config.schema import RewardConfig
from minisparse.grpo.batch import RolloutBatch
from minisparse.grpo.rewards import overlong_penalty, set_rewards


def test_overlong_penalty_rises_linearly_over_the_buffer():
    """max_len 20, buffer 8: nothing up to 12 tokens, then 1/8 of the penalty per token."""
    lengths = torch.tensor([5, 12, 13, 16, 20])
    got = overlong_penalty(lengths, max_len=20, buffer=8, penalty=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0625, 0.25, 0.5])


def test_set_rewards_subtracts_the_penalty_and_keeps_the_scores():
    """Responses of 4, 7 and 10 tokens, max_response_len 10, buffer 4, penalty 1: rewards
    lose 0, 0.25 and 1 (the scores stay the grader's); the stats say the penalty's mean and
    share beside the grader's own."""
    n, width = 3, 10
    batch = RolloutBatch(
        prompts=[[1]] * n, responses=[[5] * k for k in (4, 7, 10)], labels=["2"] * n,
        finish_reasons=["stop", "stop", "length"], rollout_logp=torch.zeros(n, width),
        response_mask=torch.ones(n, width, dtype=torch.bool), num_compressions=[0] * n,
        evicted_tokens=[0] * n, peak_cache_tokens=[0] * n, compressed_tokens=[0] * n)
    stats = set_rewards(batch, [1.0, 1.0, 0.0], {"accuracy": 2 / 3},
                        RewardConfig(overlong_buffer=4), max_response_len=10)
    assert batch.scores.tolist() == [1.0, 1.0, 0.0]
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.75, -1.0])
    assert stats == {"accuracy": pytest.approx(2 / 3),
                     "overlong_penalty_mean": pytest.approx(1.25 / 3),
                     "overlong_penalized_frac": pytest.approx(2 / 3)}
    assert batch.grade_stats == stats
    with pytest.raises(ValueError, match="max_response_len"):
        set_rewards(batch, [1.0] * n, {}, RewardConfig(overlong_buffer=4))
