"""Corrections and loss on a batch whose rollout, old, reference and current log-probs all
differ (tests/helpers/worked_example.py has the table and the hand-worked values)."""
import math

import pytest
import torch
from worked_example import (ADVANTAGES, CASES, KL_COEF, L2, MASK, NOW, S, expected,
                            expected_loss, loss_config, tensors)

from minisparse.grpo.corrections import compute_corrections
from minisparse.grpo.loss import grpo_loss, step_denominator
from minisparse.grpo.mismatch import mismatch_metrics


def _close(actual, expect) -> None:
    torch.testing.assert_close(actual.float(), torch.as_tensor(expect).float(), rtol=1e-5,
                               atol=1e-6)


def _run(cfg, t=None):
    t = t or tensors(NOW)
    corr = compute_corrections(t["old"], t["rollout"], MASK, cfg)
    denominator = step_denominator(corr.keep, cfg.aggregation)
    loss, metrics = grpo_loss(t["now"], t["old"], ADVANTAGES, corr.weights, corr.keep, cfg,
                              denominator, t["ref"])
    return corr, loss, metrics


def test_token_level_by_hand():
    """Weights 2 -> 1.5 (rejected), 1.25, 0.75 | 1.2, 0.6 | vetoed; the kept ones average
    (1.25 + 0.75 + 1.2 + 0.6) / 4 = 0.95, so each is divided by 0.95."""
    corr, loss, m = _run(loss_config())
    assert corr.keep.tolist() == [[False, True, True], [True, True, False], [False] * 3]
    assert corr.vetoed.tolist() == [False, False, True]
    _close(corr.weights, [[0, 1.25 / 0.95, 0.75 / 0.95], [1.2 / 0.95, 0.6 / 0.95, 0], [0] * 3])
    # pg: (1.25 * -1.2 + 0.75 * -0.9 + 1.2 * 0.8 + 0.6 * 1.1) / 0.95 / 4 = -0.555 / 3.8
    assert m["train/pg_loss"].item() == pytest.approx(-0.555 / 3.8, rel=1e-5)
    # kl: (0 + (1 - ln2) + (1 - ln2) + (ln2 - 0.5)) / 4; ratios 1.3, 0.9, 0.7, 1.1
    assert m["train/kl"].item() == pytest.approx((1.5 - L2) / 4, rel=1e-5)
    assert loss.item() == pytest.approx(-0.555 / 3.8 + KL_COEF * (1.5 - L2) / 4, rel=1e-5)
    assert m["train/ratio_mean"].item() == pytest.approx((1.3 + 0.9 + 0.7 + 1.1) / 4)
    assert m["train/clip_frac"].item() == pytest.approx(2 / 4)  # 1.3 (A > 0), 0.7 (A < 0)
    assert corr.metrics["rs/rejected_token_frac"] == pytest.approx(2 / 7)  # 2 and 1e-5
    assert corr.metrics["rs/kept_token_frac"] == pytest.approx(4 / 7)
    assert corr.metrics["rs/vetoed_seqs"] == 1.0
    assert corr.metrics["tis/truncated_frac"] == pytest.approx(1 / 7)  # the 2
    assert corr.metrics["tis/raw_max"] == pytest.approx(2.0)


@pytest.mark.parametrize("tis_level, rs_level", sorted(CASES))
def test_each_level_by_hand(tis_level, rs_level):
    """Kept tokens, normalised weights, PPO term, KL, ratio and clip share at each
    importance and rejection level."""
    corr, loss, m = _run(loss_config(tis_level, rs_level))
    keep, weights = expected(tis_level, rs_level)
    assert corr.keep.tolist() == keep.tolist()
    assert corr.vetoed.tolist() == [False, False, True]
    _close(corr.weights, weights)
    want = expected_loss(keep, weights)
    for name in ("pg_loss", "kl", "ratio_mean", "clip_frac"):
        assert m[f"train/{name}"].item() == pytest.approx(want[name], rel=1e-5, abs=1e-7), name
    assert loss.item() == pytest.approx(want["loss"], rel=1e-5)


def test_unnormalised_weights_and_sample_mean():
    """normalize_weights off leaves the truncated ratios; sample_mean averages each
    sample's kept tokens first: sample 0 (1.25 * -1.2 + 0.75 * -0.9) / 2, sample 1
    (1.2 * 0.8 + 0.6 * 1.1) / 2, their mean."""
    cfg = loss_config(normalize_weights=False, aggregation="sample_mean")
    corr, loss, m = _run(cfg)
    _close(corr.weights, [[0, 1.25, 0.75], [1.2, 0.6, 0], [0] * 3])
    pg = ((-1.5 - 0.675) / 2 + (0.96 + 0.66) / 2) / 2
    assert m["train/pg_loss"].item() == pytest.approx(pg, rel=1e-5)
    kl = ((1 - L2) / 2 + (1 - L2 + L2 - 0.5) / 2) / 2
    assert m["train/kl"].item() == pytest.approx(kl, rel=1e-5)
    keep, weights = expected(normalize=False)
    assert loss.item() == pytest.approx(expected_loss(keep, weights, "sample_mean")["loss"],
                                        rel=1e-5)


def test_ratio_is_anchored_on_the_dense_old_policy():
    """The PPO ratio is pi_now / pi_old: with the sampler's log-probs in place of the old
    ones every kept ratio would be q * s (1.625, 0.675, 0.84, 0.66), not q."""
    t = tensors(NOW)
    _, _, m = _run(loss_config(), t)
    assert m["train/ratio_mean"].item() == pytest.approx(1.0)  # (1.3 + 0.9 + 0.7 + 1.1) / 4
    wrong = dict(t, old=t["rollout"])
    corr = compute_corrections(t["old"], t["rollout"], MASK, loss_config())
    _, m_wrong = grpo_loss(t["now"], wrong["old"], ADVANTAGES, corr.weights, corr.keep,
                           loss_config(), 4.0, t["ref"])
    assert m_wrong["train/ratio_mean"].item() == pytest.approx((1.625 + 0.675 + 0.84 + 0.66) / 4)


def test_mismatch_metrics_read_the_sampler_against_the_dense_policy():
    """kl_k1 = mean over the 7 response tokens of -ln s; chi2_token = mean(s^2) - 1."""
    t = tensors(NOW)
    m = mismatch_metrics(t["old"], t["rollout"], MASK)
    s = [2.0, 1.25, 0.75, 1.2, 0.6, 1.1, 1e-5]  # the table's S on the 7 response tokens
    assert torch.tensor(S)[MASK].tolist() == pytest.approx(s)
    assert m["mismatch/kl_k1"] == pytest.approx(-sum(math.log(x) for x in s) / 7, rel=1e-5)
    assert m["mismatch/chi2_token"] == pytest.approx(sum(x * x for x in s) / 7 - 1, rel=1e-5)


@pytest.mark.parametrize("advantage, q, grad", [
    # A = +1: q 1.1 inside the band: d/dc (-A w q) = -1.2 * 1.1; KL k=2: 1 - 1/k = 0.5
    #         q 1.3 clipped (above 1.2): no PPO gradient; KL k=0.5: 1 - 1/k = -1
    (1.0, [1.1, 1.3], [(-1.32 + 0.1 * 0.5) / 2, (0.1 * -1.0) / 2]),
    # A = -1: q 0.7 clipped (below 0.8): no PPO gradient; q 1.3 unclipped: +0.8 * 1.3
    (-1.0, [0.7, 1.3], [(0.1 * 0.5) / 2, (1.04 + 0.1 * -1.0) / 2]),
])
def test_gradient_of_a_two_token_sample(advantage, q, grad):
    """d loss / d log pi_now per token, token_mean over 2 tokens, weights 1.2 and 0.8
    (mean 1, so normalisation keeps them), KL coefficient 0.1, k = 2 and 0.5."""
    now = torch.log(torch.tensor([[0.4, 0.3]])).requires_grad_(True)
    old = now.detach() - torch.log(torch.tensor([q]))
    rollout = old - torch.log(torch.tensor([[1.2, 0.8]]))
    ref = now.detach() - torch.log(torch.tensor([[2.0, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    corr = compute_corrections(old, rollout, mask, loss_config())
    _close(corr.weights, [[1.2, 0.8]])
    loss, _ = grpo_loss(now, old, torch.tensor([advantage]), corr.weights, corr.keep,
                        loss_config(), 2.0, ref)
    loss.backward()
    _close(now.grad, [grad])
