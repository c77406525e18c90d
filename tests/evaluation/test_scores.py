"""minisparse/evaluation/scores.py: pass@k, avg@n and its interval, against hand-computed
values."""
import pytest

from minisparse.evaluation.scores import (accuracy_ci95, pass_at_k, pass_k_values,
                                          sample_metrics)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(32, 1, 16) == pytest.approx(0.5)  # 1 - C(31,16)/C(32,16) = 16/32
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_pass_k_values():
    assert pass_k_values(1) == [1]
    assert pass_k_values(6) == [1, 2, 4]
    assert pass_k_values(32) == [1, 2, 4, 8, 16, 32]


def _rec(problem, correct, tokens, finish="stop", timed_out=False):
    return {"problem_index": problem, "correct": correct, "tokens": tokens,
            "finish_reason": finish, "grading_timed_out": timed_out}


def test_sample_metrics_hand_computed():
    records = [
        _rec(0, True, 10), _rec(0, False, 20, "length"), _rec(0, False, 30), _rec(0, False, 40),
        _rec(1, True, 5), _rec(1, True, 5), _rec(1, False, 5, "length", True), _rec(1, False, 5),
    ]
    m = sample_metrics(records, n_samples=4)
    assert (m["problems"], m["samples"]) == (2, 8)
    assert m["accuracy"] == pytest.approx(3 / 8)
    # problem 0: c=1, problem 1: c=2
    assert m["pass_at_k"] == pytest.approx(
        {"pass@1": 0.375, "pass@2": (0.5 + 5 / 6) / 2, "pass@4": 1.0}
    )
    # per-problem accuracies 0.25 and 0.5: mean 0.375, sample variance 0.03125
    assert m["accuracy_ci95"] == pytest.approx(1.96 * (0.03125 / 2) ** 0.5)
    assert m["mean_response_tokens"] == pytest.approx(120 / 8)
    assert m["truncated_fraction"] == pytest.approx(0.25)
    assert m["grading_timeouts"] == 1


def test_accuracy_interval_hand_values():
    # 500 problems, one sample each, half right: 1.96 * sqrt(0.25 * 500 / 499 / 500)
    assert accuracy_ci95([1.0] * 250 + [0.0] * 250) == pytest.approx(0.04387, abs=1e-5)
    assert accuracy_ci95([1.0] * 10) == 0.0  # every problem solved: no spread
    assert accuracy_ci95([1.0]) is None  # one problem: no interval
