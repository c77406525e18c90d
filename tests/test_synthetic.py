import re

import pytest

from minisparse.reward import math_reward
from minisparse.synthetic import synthetic_rows


def test_deterministic_and_seed_dependent():
    assert synthetic_rows(50, seed=3) == synthetic_rows(50, seed=3)
    assert synthetic_rows(50, seed=3) != synthetic_rows(50, seed=4)
    assert synthetic_rows(20, seed=3) == synthetic_rows(50, seed=3)[:20]  # prefix-stable
    assert synthetic_rows(0) == []
    with pytest.raises(ValueError):
        synthetic_rows(-1)


def test_labels_are_the_true_results_and_graded_by_math_reward():
    rows = synthetic_rows(60, seed=0)
    ops = set()
    for row in rows:
        expr = re.search(r"What is \$(.+)\$\?", row["prompt"]).group(1)
        ops.add(expr.split()[1])
        assert str(eval(expr.replace("\\times", "*"))) == row["label"]
        assert "\\boxed{}" in row["prompt"]
    assert ops == {"+", "-", "\\times"}
    for row in rows[:10]:
        wrong = str(int(row["label"]) + 1)
        assert math_reward(f"So the result is \\boxed{{{row['label']}}}.", row["label"]) == 1.0
        assert math_reward(f"So the result is \\boxed{{{wrong}}}.", row["label"]) == 0.0
