import re

import pytest

from minisparse.data.reward import math_reward
from minisparse.data.synthetic import synthetic_rows


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



def test_held_out_split_is_disjoint_from_training_by_construction():
    import random

    from minisparse.data.synthetic import HELD_OUT_EVERY, _problem, split_of, synthetic_problems

    train = {q for q, _ in synthetic_problems(3000, seed=0)}
    train |= {q for q, _ in synthetic_problems(3000, seed=7)}
    held = synthetic_problems(300, seed=1234, split="heldout")
    assert len({q for q, _ in held}) > 250  # distinct problems, not one repeated
    assert not train & {q for q, _ in held}
    for q, a in held:
        expr = q[len("What is $"):-2]
        assert split_of(expr) == "heldout"
        assert str(eval(expr.replace("\\times", "*"))) == a
    assert {q.split()[3] for q, _ in held} == {"+", "-", "\\times"}
    rng = random.Random(5)  # about 1 in HELD_OUT_EVERY of all problems is held out
    share = sum(split_of(_problem(rng)[0]) == "heldout" for _ in range(5000)) / 5000
    assert abs(share - 1 / HELD_OUT_EVERY) < 0.02
    with pytest.raises(ValueError, match="split must be one of"):
        synthetic_problems(1, 0, "test")
