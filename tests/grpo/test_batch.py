"""The rollout batch's metrics, from its fields."""
import pytest
import torch

from minisparse.grpo.batch import RolloutBatch, rollout_metrics


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
