"""score_batch: rewards from the grader, with the processes and limit the config asks for."""
import pytest
import torch

from minisparse.config.schema import RewardConfig
from minisparse.grpo.rollout import RolloutBatch, rollout_metrics, score_batch


class CharTokenizer:
    """Token ids are character codes."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(chr, row)) for row in ids]


def test_score_batch_grades_with_the_workers_and_limit_given(grade_calls):
    texts = ["\\boxed{2}", "\\boxed{3}", "no answer"]
    batch = RolloutBatch(
        prompts=[[1]] * 3, responses=[list(map(ord, t)) for t in texts], labels=["2"] * 3,
        finish_reasons=["stop"] * 3, rollout_logp=torch.zeros(3, 9),
        response_mask=torch.ones(3, 9, dtype=torch.bool), num_compressions=[0] * 3,
        evicted_tokens=[0] * 3, peak_cache_tokens=[0] * 3, compressed_tokens=[0] * 3)
    stats = score_batch(batch, CharTokenizer(), RewardConfig(workers=4, timeout_s=0.7))
    assert grade_calls == [(4, 0.7)]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0]
    assert stats["accuracy"] == 1 / 3 and stats["no_answer"] == 1


def test_compressed_token_share_is_over_all_response_tokens():
    """compress/compressed_token_frac: tokens sampled after an eviction over every response
    token of the rollout (3 of 4 and 0 of 6: 0.3), not a mean of per-sample shares."""
    batch = RolloutBatch(
        prompts=[[1]] * 2, responses=[[5] * 4, [5] * 6], labels=["2"] * 2,
        finish_reasons=["stop"] * 2, rollout_logp=torch.zeros(2, 6),
        response_mask=torch.ones(2, 6, dtype=torch.bool), num_compressions=[1, 0],
        evicted_tokens=[4, 0], peak_cache_tokens=[8, 9], compressed_tokens=[3, 0])
    batch.rewards = torch.tensor([1.0, 0.0])
    assert rollout_metrics(batch)["compress/compressed_token_frac"] == pytest.approx(0.3)
