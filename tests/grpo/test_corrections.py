import math

import pytest
import torch

from minisparse.config.schema import LossConfig
from minisparse.grpo.corrections import (
    bound_weights,
    compute_corrections,
    level_log_ratio,
    log_ratio,
    rejection,
)

L2 = math.log(2.0)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6
    )


def _cfg(**kw) -> LossConfig:
    base = {"use_tis": True, "use_rs": False, "normalize_weights": False}
    base.update(kw)
    return LossConfig(**base)


def _against_uniform_sampler(old_logp: list[list[float]], **cfg):
    """Corrections of dense log-probs old_logp against a sampler whose log-probs are all 0
    (so each token's ratio is exp(old_logp)), every token a response token."""
    old = torch.tensor(old_logp)
    return compute_corrections(old, torch.zeros_like(old), torch.ones_like(old, dtype=torch.bool),
                               _cfg(**cfg))


def test_log_ratio_clamped_and_masked():
    old = torch.tensor([[0.0, -30.0, 0.0]])
    roll = torch.tensor([[-1.0, 0.0, 5.0]])
    mask = torch.tensor([[True, True, False]])
    assert log_ratio(old, roll, mask).tolist() == [[1.0, -20.0, 0.0]]


def test_levels():
    delta = torch.tensor([[L2, 0.0, -L2 * 3], [L2, L2, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    tok = level_log_ratio(delta, mask, "token").exp()
    seq = level_log_ratio(delta, mask, "sequence").exp()
    geo = level_log_ratio(delta, mask, "geometric").exp()
    close(tok[0], [2.0, 1.0, 0.125])
    assert seq[0].tolist() == pytest.approx([0.25] * 3)  # 2 * 1 * 1/8
    assert seq[1].tolist() == pytest.approx([4.0, 4.0, 1.0])  # padding -> exp(0), masked later
    close(geo[0], [0.25 ** (1 / 3)] * 3)
    assert geo[1, :2].tolist() == pytest.approx([2.0, 2.0])  # mean over 2 valid tokens


def test_bound_modes():
    raw = torch.tensor([0.2, 0.5, 1.0, 1.5, 3.0])
    assert bound_weights(raw, "truncate", 0.5, 1.5).tolist() == pytest.approx(
        [0.2, 0.5, 1.0, 1.5, 1.5]
    )
    assert bound_weights(raw, "clip", 0.5, 1.5).tolist() == pytest.approx([0.5, 0.5, 1.0, 1.5, 1.5])
    assert bound_weights(raw, "mask", 0.5, 1.5).tolist() == pytest.approx([0.0, 0.5, 1.0, 1.5, 0.0])


def test_token_truncate_weights_and_metrics():
    # token ratios 2, 1, 0.5 | 1.25 (pad)
    old = torch.tensor([[L2, 0.0, -L2], [math.log(1.25), 0.0, 0.0]])
    roll = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    c = compute_corrections(old, roll, mask, _cfg(tis_mode="truncate"))
    close(c.weights, [[1.5, 1.0, 0.5], [1.25, 0.0, 0.0]])
    assert c.keep.tolist() == mask.tolist()
    assert c.metrics["tis/truncated_frac"] == pytest.approx(0.25)
    assert c.metrics["tis/raw_mean"] == pytest.approx((2 + 1 + 0.5 + 1.25) / 4)
    assert c.metrics["tis/raw_max"] == pytest.approx(2.0)
    assert c.metrics["tis/bounded_mean"] == pytest.approx((1.5 + 1 + 0.5 + 1.25) / 4)


def test_sequence_clip_weights():
    # sequence ratios: 2*2 = 4 -> clipped to 1.5; 0.5*0.5 = .25 -> clipped up to 0.5
    c = _against_uniform_sampler([[L2, L2], [-L2, -L2]], tis_level="sequence", tis_mode="clip")
    close(c.weights, [[1.5, 1.5], [0.5, 0.5]])


def test_geometric_mask_weights():
    # geometric means: sqrt(2*4)=2.83 -> masked to 0; sqrt(2*0.5)=1 -> kept
    c = _against_uniform_sampler([[L2, 2 * L2], [L2, -L2]], tis_level="geometric",
                                 tis_mode="mask")
    close(c.weights, [[0.0, 0.0], [1.0, 1.0]])


def test_rejection_and_veto_counts():
    # seq 0: ratios 2 (rejected, > 1.5), 1 -> one token out
    # seq 1: ratios 1, 1e-5 (< veto 1e-4) -> whole sequence vetoed
    # seq 2: ratios 1, 1 -> kept
    old = torch.tensor([[L2, 0.0], [0.0, math.log(1e-5)], [0.0, 0.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    keep, rejected, vetoed = rejection(
        log_ratio(old, torch.zeros(3, 2), mask), mask, "token", 0.5, 1.5, 1e-4
    )
    assert keep.tolist() == [[False, True], [False, False], [True, True]]
    assert rejected.tolist() == [[True, False], [False, True], [False, False]]
    assert vetoed.tolist() == [False, True, False]
    c = compute_corrections(old, torch.zeros(3, 2), mask, _cfg(use_rs=True))
    # Exactly one sequence is vetoed (the reference code counted the survivors instead).
    assert c.metrics["rs/vetoed_seqs"] == 1.0
    assert c.metrics["rs/vetoed_frac"] == pytest.approx(1 / 3)
    assert c.metrics["rs/rejected_token_frac"] == pytest.approx(2 / 6)  # 2.0 and 1e-5
    assert c.metrics["rs/kept_token_frac"] == pytest.approx(3 / 6)
    close(c.weights, [[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])


def test_veto_off_with_zero_threshold():
    old = torch.tensor([[0.0, math.log(1e-5)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    c = compute_corrections(old, torch.zeros(1, 2), mask, _cfg(use_rs=True, rs_veto_threshold=0.0))
    assert c.metrics["rs/vetoed_seqs"] == 0.0
    assert c.keep.tolist() == [[True, False]]  # still rejected by the lower bound


def test_batch_normalisation_over_kept_tokens():
    # ratios 1.25, 1.25 | 1.0, 0.7, all kept: each weight is divided by their mean 1.05
    old = torch.tensor([[math.log(1.25), math.log(1.25)], [0.0, math.log(0.7)]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    c = compute_corrections(old, torch.zeros(2, 2), mask, _cfg(use_rs=True, normalize_weights=True))
    mean = (1.25 + 1.25 + 1.0 + 0.7) / 4
    close(c.weights, [[1.25 / mean, 1.25 / mean], [1 / mean, 0.7 / mean]])
    assert c.metrics["tis/final_mean"] == pytest.approx(1.0)


def test_everything_off_is_plain_grpo():
    old = torch.tensor([[L2, math.log(1e-6)]])
    mask = torch.tensor([[True, True]])
    c = compute_corrections(
        old, torch.zeros(1, 2), mask, _cfg(use_tis=False, use_rs=False, normalize_weights=True)
    )
    assert c.weights.tolist() == [[1.0, 1.0]]
    assert c.keep.tolist() == [[True, True]]


# Three sequences of four response tokens (the last one padding in seq 2), ratios:
#   seq 0: 3, 1/3, 1, 1   -> product 1,      geometric mean 1
#   seq 1: 1.2 x 4        -> product 2.0736, geometric mean 1.2
#   seq 2: 2, 2, 1 (+pad) -> product 4,      geometric mean 4^(1/3) = 1.587
LEVEL_RATIOS = [[3.0, 1 / 3, 1.0, 1.0], [1.2, 1.2, 1.2, 1.2], [2.0, 2.0, 1.0, 1.0]]
LEVEL_MASK = [[True] * 4, [True] * 4, [True, True, True, False]]


@pytest.mark.parametrize("level, keep_rows, rejected_seq_frac", [
    # token: each token against [0.5, 1.5] on its own
    ("token", [[False, False, True, True], [True] * 4, [False, False, True, False]], 0.0),
    # sequence: seq 1 (2.07) and seq 2 (4) leave whole, seq 0 (1) stays
    ("sequence", [[True] * 4, [False] * 4, [False] * 4], 2 / 3),
    # geometric: only seq 2 (1.587 > 1.5) leaves
    ("geometric", [[True] * 4, [True] * 4, [False] * 4], 1 / 3),
])
def test_rejection_levels_on_hand_computed_ratios(level, keep_rows, rejected_seq_frac):
    old = torch.tensor(LEVEL_RATIOS).log()
    mask = torch.tensor(LEVEL_MASK)
    # token TIS whatever the rejection level: weights stay per token, truncated at 1.5
    c = compute_corrections(old, torch.zeros_like(old), mask,
                            _cfg(use_rs=True, rs_level=level, rs_veto_threshold=0.0))
    expected_keep = torch.tensor(keep_rows) & mask
    assert c.keep.tolist() == expected_keep.tolist()
    assert c.metrics["rs/rejected_seq_frac"] == pytest.approx(rejected_seq_frac)
    assert c.metrics["rs/kept_token_frac"] == pytest.approx(expected_keep.sum().item() / 11)
    token_weights = torch.tensor(LEVEL_RATIOS).clamp(max=1.5)
    close(c.weights, torch.where(expected_keep, token_weights, 0.0).tolist())


def test_rejection_level_defaults_to_the_importance_level():
    old = torch.tensor(LEVEL_RATIOS).log()
    mask = torch.tensor(LEVEL_MASK)
    by_default = compute_corrections(old, torch.zeros_like(old), mask,
                                     _cfg(use_rs=True, tis_level="geometric"))
    named = compute_corrections(old, torch.zeros_like(old), mask,
                                _cfg(use_rs=True, tis_level="geometric", rs_level="geometric"))
    assert by_default.keep.tolist() == named.keep.tolist() == [[True] * 4, [True] * 4,
                                                                 [False] * 4]
    assert LossConfig(tis_level="sequence").rejection_level() == "sequence"
    assert LossConfig(tis_level="sequence", rs_level="token").rejection_level() == "token"
