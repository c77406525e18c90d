"""minisparse/evaluation/paired.py: the paired test of two checkpoints, pooled over seeds,
the difference of scores alone, and non-inferiority, against hand-computed values."""
import math

import pytest

from minisparse.evaluation.paired import (Difference, paired_differences, paired_test,
                                          score_difference)
from minisparse.evaluation.scores import per_problem_accuracy

PHI_2 = 0.9772498680518208  # the standard normal's CDF at 2
PHI_1 = 0.8413447460685429  # and at 1


def _rec(problem, correct):
    return {"problem_index": problem, "correct": correct}


def test_one_seed_is_the_plain_paired_test():
    base = per_problem_accuracy([_rec(0, True), _rec(0, False), _rec(1, True), _rec(1, True),
                                 _rec(2, False), _rec(2, False)])
    assert base == {0: 0.5, 1: 1.0, 2: 0.0}
    diff = paired_test([paired_differences(base, {0: 1.0, 1: 1.0, 2: 0.5})])
    # differences 0.5, 0, 0.5: mean 1/3, sample variance 1/12, over 3 problems: se 1/6
    assert (diff.mean, diff.count) == (pytest.approx(1 / 3), 3)
    assert diff.se == pytest.approx(1 / 6)
    assert diff.ci95 == pytest.approx(1.96 / 6)
    assert diff.p_value == pytest.approx(2 * (1 - PHI_2))  # z = 2: p = 0.0455
    assert diff.lower_bound == pytest.approx(1 / 3 - 1.6448536 / 6)  # 0.0592
    assert diff.non_inferior(0.02) is True


def test_seeds_pool_by_problem():
    """A problem whose differences agree across seeds counts once in the spread: the
    interval is wider than if the four (seed, problem) pairs were unrelated."""
    seeds = [{0: 1.0, 1: 0.0}, {0: 1.0, 1: -1.0}]
    diff = paired_test(seeds)
    # mean 1/4; problem 0 sums 0.75 + 0.75, problem 1 -0.25 - 1.25: 2/1 * (1.5^2 + 1.5^2) / 4^2
    assert diff.mean == pytest.approx(0.25) and diff.count == 4
    assert diff.se == pytest.approx(0.75)
    unrelated = math.sqrt((0.75**2 + 0.25**2 + 0.75**2 + 1.25**2) / 3 / 4)
    assert unrelated == pytest.approx(0.4787, abs=1e-4) and diff.se > unrelated
    # one seed alone: the paired test's own se, sqrt(var([1, 0]) / 2) = 0.5
    assert paired_test(seeds[:1]).se == pytest.approx(0.5)


def test_scores_alone_combine_their_intervals_as_unrelated():
    # seed 1: 0.40 -> 0.42, each +-0.0392 (se 0.02); seed 2: 0.35 -> 0.36, +-0.0196 (se 0.01)
    diff = score_difference([((0.40, 0.0392), (0.42, 0.0392)), ((0.35, 0.0196), (0.36, 0.0196))])
    assert diff.mean == pytest.approx(0.015) and diff.count == 2
    assert diff.se == pytest.approx(math.sqrt(0.02**2 * 2 + 0.01**2 * 2) / 2)  # 0.0158
    assert diff.p_value == pytest.approx(0.34278, abs=1e-5)  # z = 0.015 / 0.0158 = 0.949
    assert score_difference([((0.4, None), (0.5, 0.04))]).se is None


def test_non_inferiority_reads_the_one_sided_bound():
    diff = Difference(mean=-0.01, se=0.005, count=500)
    assert diff.lower_bound == pytest.approx(-0.01 - 1.6448536 * 0.005)  # -0.0182
    assert diff.non_inferior(0.02) is True and diff.non_inferior(0.015) is False
    assert Difference(0.25, 0.25, 4).p_value == pytest.approx(2 * (1 - PHI_1))
    assert Difference(0.0, 0.0, 3).p_value == 1.0 and Difference(0.1, 0.0, 3).p_value == 0.0
    none = Difference(0.1, None, 1)
    assert (none.ci95, none.p_value, none.lower_bound, none.non_inferior(0.02)) == (None,) * 4


def test_mismatched_or_empty_inputs_are_named():
    with pytest.raises(ValueError, match="same problems: 2 scored by one side only"):
        paired_differences({0: 0.5, 1: 1.0}, {0: 1.0, 3: 0.0})
    with pytest.raises(ValueError, match="at least one problem"):
        paired_test([{}])
    with pytest.raises(ValueError, match="at least one seed"):
        score_difference([])
    assert paired_test([{0: 0.5}]).se is None  # one problem: no spread to estimate
