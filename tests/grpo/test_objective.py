"""One micro-batch's GRPO loss read out of the rollout batch (grpo/objective.py), on the
worked example (tests/helpers/worked_example.py): the sampler, dense old, reference and current
log-probs all differ, so taking any of them for another, or the response mask for the
kept tokens or the weights, changes a checked number."""
from dataclasses import replace

import pytest
import torch
from update_helpers import rollout_batch
from worked_example import (ADVANTAGES, MASK, NOW, PROMPTS, RESPONSES, expected,
                            expected_loss, loss_config, tensors)

from minisparse.grpo.corrections import compute_corrections
from minisparse.grpo.loss import step_denominator
from minisparse.grpo.objective import micro_batch_loss
from minisparse.grpo.batch import RolloutBatch

def _batch(cfg) -> RolloutBatch:
    """The worked example as the log-prob phase leaves it: old, reference, weights, keep."""
    t = tensors(NOW)
    corr = compute_corrections(t["old"], t["rollout"], MASK, cfg)
    return replace(rollout_batch(PROMPTS, RESPONSES, t["rollout"]), advantages=ADVANTAGES,
                   old_logp=t["old"], ref_logp=t["ref"], weights=corr.weights,
                   keep=corr.keep)


@pytest.mark.parametrize("tis_level, rs_level", [("token", "token"), ("geometric", "geometric")])
def test_whole_batch_is_the_hand_worked_loss(tis_level, rs_level):
    cfg = loss_config(tis_level, rs_level)
    batch = _batch(cfg)
    keep, weights = expected(tis_level, rs_level)
    loss, metrics = micro_batch_loss(NOW, None, batch, [0, 1, 2], cfg,
                                     step_denominator(batch.keep, cfg.aggregation))
    want = expected_loss(keep, weights)
    assert loss.item() == pytest.approx(want["loss"], rel=1e-5)
    for name in ("pg_loss", "kl", "ratio_mean", "clip_frac"):
        assert metrics[f"train/{name}"].item() == pytest.approx(want[name], rel=1e-5), name


def test_micro_batches_of_a_step_sum_to_its_loss():
    """Rows in any order and split over micro-batches: each takes its own rows of every
    tensor, and over the step's shared count their losses add up to the whole batch's."""
    cfg = loss_config("geometric", "geometric")
    batch = _batch(cfg)
    denominator = step_denominator(batch.keep, cfg.aggregation)
    whole, _ = micro_batch_loss(NOW, None, batch, [0, 1, 2], cfg, denominator)
    parts = [micro_batch_loss(NOW[rows], None, batch, rows, cfg, denominator)[0]
             for rows in ([1], [2, 0])]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-5)
    keep, weights = expected("geometric", "geometric")
    # sample 1 alone, over the step's 5 kept tokens: A = -1, PPO terms 0.8 and 1.1
    pg = (0.8 * weights[1, 0] + 1.1 * weights[1, 1]).item() / keep.sum().item()
    kl = expected_loss(keep * torch.tensor([[0], [1], [0]]).bool(), weights)["kl"] * 2 / 5
    assert parts[0].item() == pytest.approx(pg + cfg.kl_coef * kl, rel=1e-5)
