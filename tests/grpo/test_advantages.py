import math

import pytest
import torch

from minisparse.grpo.advantages import group_advantages


def test_grpo_advantage_hand_computed():
    # group 1: rewards 1,0,0,1 -> mean .5, unbiased std sqrt(1/3) = 0.57735
    # group 2: all zero -> zero advantage, one zero-signal group
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    adv, stats = group_advantages(rewards, group_size=4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], abs=1e-6)
    assert stats["advantage/zero_signal_groups"] == 1.0
    assert stats["advantage/zero_signal_frac"] == 0.5


def test_dr_grpo_skips_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv, stats = group_advantages(rewards, group_size=4, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert stats["advantage/zero_signal_groups"] == 0.0


def test_uneven_groups_rejected():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), group_size=4)
