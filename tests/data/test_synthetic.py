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


def test_difficulty_sets_operands_operators_and_chain_length():
    from minisparse.data.synthetic import Difficulty, synthetic_problems

    easy = Difficulty(max_operand=9, operators=("+",))
    for q, a in synthetic_problems(200, seed=0, level=easy):
        a_, op, b = q[len("What is $"):-2].split()
        assert op == "+" and 1 <= int(a_) <= 9 and 1 <= int(b) <= 9
        assert int(a) == int(a_) + int(b)
    chained = Difficulty(max_operand=50, operators=("+", "-", "*"), operations=3)
    seen = set()
    for q, a in synthetic_problems(300, seed=1, level=chained):
        expr = q[len("What is $"):-2]
        parts = expr.split()
        assert len(parts) == 7  # 4 operands, 3 operators
        seen.update(parts[1::2])
        assert str(eval(expr.replace("\\times", "*"))) == a  # usual precedence
        for i, n in enumerate(parts[::2]):  # a factor of x stays within 2..30
            near = parts[max(2 * i - 1, 1):2 * i + 2:2]
            assert int(n) <= (30 if "\\times" in near else 50)
    assert seen == {"+", "-", "\\times"}


def test_easy_difficulty_keeps_the_held_out_split_disjoint():
    """Few distinct problems (81 sums of digits): the training rows repeat them, and the
    held-out ones are still never among them."""
    from minisparse.data.synthetic import Difficulty, split_of, synthetic_problems

    easy = Difficulty(max_operand=9, operators=("+",))
    train = {q for q, _ in synthetic_problems(2000, seed=0, level=easy)}
    held = {q for q, _ in synthetic_problems(50, seed=3, split="heldout", level=easy)}
    assert held and not train & held
    assert all(split_of(q[len("What is $"):-2]) == "heldout" for q in held)
    assert len(train) + len(held) <= 81


def test_a_split_with_no_problem_fails_instead_of_hanging():
    from minisparse.data.synthetic import Difficulty, split_of, synthetic_problems

    one = Difficulty(max_operand=1, operators=("+",))  # only "1 + 1"
    split = "train" if split_of("1 + 1") == "heldout" else "heldout"
    with pytest.raises(ValueError, match="too few distinct problems"):
        synthetic_problems(1, split=split, level=one)


def test_default_difficulty_is_the_set_the_ablation_trained_on():
    """The data.synthetic_* defaults leave the generated rows as they were (docs/results.md
    trained on them): the first rows of seed 0, as generated before the keys existed."""
    from minisparse.data.synthetic import synthetic_problems

    assert synthetic_problems(3, seed=0) == [
        ("What is $777 - 912$?", "-135"), ("What is $42 - 266$?", "-224"),
        ("What is $17 \\times 14$?", "238")]
