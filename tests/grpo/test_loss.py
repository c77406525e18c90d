import math

import pytest
import torch

from minisparse.config.schema import LossConfig
from minisparse.grpo.loss import aggregate, grpo_loss, kl_penalty, ppo_clip_loss, step_denominator


def test_ppo_clip_hand_computed():
    # ratios 1.5, 0.5, 1.1 ; advantages +1, +1, -1 ; eps 0.2
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    loss, clipped, ratio = ppo_clip_loss(logp, old, torch.tensor([[1.0, 1.0, -1.0]]), 0.2)
    # +A, r=1.5: max(-1.5, -1.2) = -1.2 (clipped); +A, r=.5: max(-.5, -.8) = -.5;
    # -A, r=1.1: max(1.1, 1.1) = 1.1 (inside the band)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.1]]))
    assert clipped.tolist() == [[True, False, False]]
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 0.5, 1.1]]))


def test_ppo_clip_high_bound_and_broadcast():
    logp = torch.log(torch.tensor([[1.25, 1.35]]))
    loss, clipped, _ = ppo_clip_loss(
        logp, torch.zeros(1, 2), torch.tensor([2.0]), 0.2, eps_clip_high=0.28
    )
    torch.testing.assert_close(loss, torch.tensor([[-2.5, -2.56]]))  # 1.35 clipped to 1.28
    assert clipped.tolist() == [[False, True]]


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("k1", [math.log(2), -math.log(2)]),
        ("k2", [0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2]),
        ("k3", [0.5 + math.log(2) - 1, 2 - math.log(2) - 1]),
        ("low_var_kl", [0.5 + math.log(2) - 1, 2 - math.log(2) - 1]),
    ],
)
def test_kl_estimators(kind, expected):
    logp = torch.log(torch.tensor([2.0, 1.0]))
    ref = torch.log(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, kind), torch.tensor(expected))


def test_low_var_kl_is_bounded():
    logp, ref = torch.tensor([0.0]), torch.tensor([30.0])
    assert kl_penalty(logp, ref, "low_var_kl").item() == 10.0
    assert kl_penalty(logp, ref, "k3").item() > 1e8


def test_aggregations():
    values = torch.tensor([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0]])
    keep = torch.tensor([[True, True, False], [True, False, False]])
    assert step_denominator(keep, "token_mean") == 3.0
    assert step_denominator(keep, "sample_mean") == 2.0
    assert aggregate(values, keep, "token_mean", 3.0).item() == pytest.approx(2.0)  # (1+3+2)/3
    assert aggregate(values, keep, "sample_mean", 2.0).item() == pytest.approx(2.0)  # (2 + 2)/2
    keep2 = torch.tensor([[True, False, False], [True, False, False]])
    assert aggregate(values, keep2, "sample_mean", 2.0).item() == pytest.approx(1.5)


def test_micro_batches_sum_to_step_mean():
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 7.0]])
    keep = torch.tensor([[True, True], [True, False], [True, True]])
    for mode in ("token_mean", "sample_mean"):
        denom = step_denominator(keep, mode)
        whole = aggregate(values, keep, mode, denom)
        parts = aggregate(values[:1], keep[:1], mode, denom) + aggregate(
            values[1:], keep[1:], mode, denom
        )
        assert parts.item() == pytest.approx(whole.item())


def test_grpo_loss_weights_kl_entropy():
    cfg = LossConfig(kl_coef=0.5, kl_type="k1", entropy_coef=0.1, aggregation="token_mean")
    logp = torch.log(torch.tensor([[1.0, 1.0]]))  # ratio 1 against old
    old = torch.zeros(1, 2)
    weights = torch.tensor([[2.0, 0.5]])
    keep = torch.tensor([[True, True]])
    ref = torch.tensor([[-1.0, 0.0]])  # k1 = 1, 0 -> mean 0.5
    entropy = torch.tensor([[2.0, 4.0]])
    loss, m = grpo_loss(logp, old, torch.tensor([1.0]), weights, keep, cfg, 2.0, ref, entropy)
    # pg: -A * r * w = -2, -0.5 -> mean -1.25; + 0.5 * 0.5 - 0.1 * 3
    assert m["train/pg_loss"].item() == pytest.approx(-1.25)
    assert m["train/kl"].item() == pytest.approx(0.5)
    assert m["train/entropy"].item() == pytest.approx(3.0)
    assert loss.item() == pytest.approx(-1.25 + 0.25 - 0.3)
    assert m["train/clip_frac"].item() == 0.0


def test_rejected_tokens_leave_the_loss():
    cfg = LossConfig(kl_coef=0.0, aggregation="sample_mean")
    logp = torch.zeros(2, 2, requires_grad=True)
    keep = torch.tensor([[True, False], [False, False]])
    loss, _ = grpo_loss(
        logp, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), torch.ones(2, 2), keep, cfg, 1.0
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad.tolist() == [[-1.0, 0.0], [0.0, 0.0]]


def test_step_denominator_share_below_one_is_not_clamped():
    """4 ranks, one kept sample in the whole step: each rank divides by 1/4, so after
    DeepSpeed's mean over ranks the kept sample's gradient has its full weight."""
    keep = torch.tensor([[True, True]])
    values = torch.tensor([[2.0, 4.0]])
    per_rank = aggregate(values, keep, "sample_mean", 1.0 / 4)
    assert per_rank.item() == pytest.approx(3.0 * 4)
