import math

import pytest
import torch

from minisparse.grpo.mismatch import mismatch_metrics


def test_identical_policies_have_no_mismatch():
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 1.0]]))
    m = mismatch_metrics(lp, lp, torch.tensor([[True, True], [True, False]]))
    assert m["mismatch/kl_k1"] == pytest.approx(0.0)
    assert m["mismatch/kl_k3"] == pytest.approx(0.0)
    assert m["mismatch/chi2_token"] == pytest.approx(0.0, abs=1e-6)
    assert m["mismatch/chi2_seq"] == pytest.approx(0.0, abs=1e-6)
    assert m["mismatch/ppl_ratio"] == pytest.approx(1.0)
    # ppl: seq 0 exp(-mean(log .5, log .25)) = sqrt(8); seq 1 exp(-log .5) = 2
    assert m["mismatch/rollout_ppl"] == pytest.approx((math.sqrt(8) + 2) / 2)


def test_hand_computed_mismatch():
    # one sequence, token ratios r = 2 and 0.5 (dense / rollout)
    roll = torch.log(torch.tensor([[0.25, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    m = mismatch_metrics(old, roll, torch.ones(1, 2, dtype=torch.bool))
    assert m["mismatch/kl_k1"] == pytest.approx(0.0)  # -(log 2 - log 2)/2
    assert m["mismatch/kl_k3"] == pytest.approx(
        ((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2
    )
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 0.25) / 2 - 1)
    assert m["mismatch/chi2_seq"] == pytest.approx(0.0, abs=1e-6)  # prod r = 1
    assert m["mismatch/ppl_ratio"] == pytest.approx(1.0)
