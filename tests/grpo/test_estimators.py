"""loss.advantage: gspo's sequence-level ratio and clipping, REINFORCE++'s batch-whitened
returns, and how each meets the Sparse-RL correction weights; hand-computed cases."""
import math

import pytest
import torch

from minisparse.config.load import load_config
from minisparse.config.schema import ConfigError, LossConfig
from minisparse.grpo.advantages import compute_advantages
from minisparse.grpo.corrections import compute_corrections
from minisparse.grpo.loss import grpo_loss, sequence_log_ratio


def _adv(name: str, rewards, lengths, group_size=2, **kw):
    cfg = LossConfig(advantage=name, **kw)
    return compute_advantages(torch.tensor(rewards), group_size, torch.tensor(lengths), cfg)


def test_reinforce_plus_plus_whitens_rewards_over_the_batch_tokens():
    # rewards 1, 0 | 1, 1 with lengths 3, 1, 1, 1: token mean 5/6, E[x^2] 5/6,
    # variance 5/6 - 25/36 = 5/36, std sqrt(5)/6 -> 1/sqrt(5) for a 1, -sqrt(5) for a 0
    adv, stats = _adv("reinforce_plus_plus", [1.0, 0.0, 1.0, 1.0], [3, 1, 1, 1])
    s = 1 / math.sqrt(5)
    assert adv.tolist() == pytest.approx([s, -math.sqrt(5), s, s], abs=1e-5)
    # the all-right group still moves the policy (no per-prompt baseline), yet is counted
    assert stats["advantage/zero_signal_groups"] == 1


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_first():
    # centred 0.5, -0.5 | 0, 0: mean 0, population std sqrt(0.125) -> +-sqrt(2), 0, 0
    adv, _ = _adv("reinforce_plus_plus_baseline", [1.0, 0.0, 1.0, 1.0], [1, 1, 1, 1])
    assert adv.tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0], abs=1e-5)
    # a batch with no signal anywhere gives zeros, not a division by zero
    adv, _ = _adv("reinforce_plus_plus", [0.0] * 4, [2] * 4)
    assert adv.tolist() == [0.0] * 4


def test_gspo_advantages_are_grpo_s():
    rewards, lengths = [1.0, 0.0, 0.0, 0.0], [5, 1, 2, 9]
    grpo, _ = _adv("grpo", rewards, lengths, group_size=4)
    gspo, _ = _adv("gspo", rewards, lengths, group_size=4)
    assert gspo.tolist() == grpo.tolist()


def test_gspo_ratio_is_the_mean_log_ratio_over_kept_tokens():
    logp = torch.tensor([[0.3, -0.1, 0.4]])
    keep = torch.tensor([[True, True, False]])
    assert sequence_log_ratio(logp, torch.zeros(1, 3), keep)[0].tolist() == pytest.approx(
        [0.1, 0.1, 0.1])


def _gspo_loss(delta, adv, weights, keep, **kw):
    """(loss, metrics, d loss / d logp) for log-ratios delta = logp - old_logp."""
    logp = torch.tensor(delta, requires_grad=True)
    cfg = LossConfig(kl_coef=0.0, **kw)
    keep = torch.tensor(keep)
    loss, m = grpo_loss(logp, torch.zeros_like(logp), torch.tensor(adv), torch.tensor(weights),
                        keep, cfg, float(keep.any(dim=1).sum()))
    loss.backward()
    return loss.item(), m, logp.grad


def test_gspo_clips_the_sequence_ratio_at_its_own_bounds():
    # s = exp(mean(0.3, -0.1)) = exp(0.1) = 1.105 > 1 + 4e-4
    delta, keep = [[0.3, -0.1, 0.4]], [[True, True, False]]
    # A = +1: clipped at 1.0004, no gradient
    loss, m, grad = _gspo_loss(delta, [1.0], [[1.0, 1.0, 1.0]], keep, advantage="gspo")
    assert loss == pytest.approx(-1.0004)
    assert grad[0].tolist() == [0.0, 0.0, 0.0]
    assert m["train/clip_frac"].item() == 1.0
    # A = -1: the unclipped s is the max; d s / d logp_t = s / 2 for both kept tokens
    loss, _, grad = _gspo_loss(delta, [-1.0], [[1.0, 1.0, 1.0]], keep, advantage="gspo")
    s = math.exp(0.1)
    assert loss == pytest.approx(s)
    assert grad[0].tolist() == pytest.approx([s / 2, s / 2, 0.0])
    # grpo on the same tokens clips each token's ratio at 0.2: 0.3 is clipped, -0.1 is not
    loss, _, grad = _gspo_loss(delta, [1.0], [[1.0, 1.0, 1.0]], keep, advantage="grpo")
    assert loss == pytest.approx(-(1.2 + math.exp(-0.1)) / 2)
    assert grad[0].tolist() == pytest.approx([0.0, -math.exp(-0.1) / 2, 0.0])


def test_gspo_meets_token_weights_as_their_mean_over_the_sequence():
    """The pg term is one value per sequence, so token weights (2, 0) act as (1, 1): their
    mean. Under grpo the same weights pick out the first token."""
    delta, keep = [[0.05, -0.1]], [[True, True]]
    even = _gspo_loss(delta, [-1.0], [[1.0, 1.0]], keep, advantage="gspo")
    skew = _gspo_loss(delta, [-1.0], [[2.0, 0.0]], keep, advantage="gspo")
    assert skew[0] == pytest.approx(even[0])
    assert skew[2][0].tolist() == pytest.approx(even[2][0].tolist())
    grpo_even = _gspo_loss(delta, [-1.0], [[1.0, 1.0]], keep, advantage="grpo")
    grpo_skew = _gspo_loss(delta, [-1.0], [[2.0, 0.0]], keep, advantage="grpo")
    assert grpo_skew[0] != pytest.approx(grpo_even[0])


def test_geometric_weights_times_gspo_ratio_is_the_ratio_against_the_sampler():
    """tis_level=geometric: w = exp(mean(old - rollout)), so w * s = exp(mean(logp -
    rollout)), GSPO's ratio measured against the compressed sampler."""
    rollout = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.2, -1.5, -0.5]])
    logp = torch.tensor([[-1.1, -1.4, -0.6]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    cfg = LossConfig(advantage="gspo", tis_level="geometric", use_rs=False,
                     normalize_weights=False)
    w = compute_corrections(old, rollout, mask, cfg).weights
    s = sequence_log_ratio(logp, old, mask).exp()
    expected = math.exp((logp - rollout).mean().item())
    assert (w * s)[0].tolist() == pytest.approx([expected] * 3)


def test_a_misspelt_estimator_lists_the_allowed_ones():
    with pytest.raises(ConfigError, match="must be one of grpo, gspo, reinforce_plus_plus, "
                                          "reinforce_plus_plus_baseline; got 'gpso'"):
        load_config("tiny_rkv", ["loss.advantage=gpso"])
