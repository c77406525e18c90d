import threading

import pytest

import minisparse.data.reward as reward
from minisparse.data.reward import Grade, extract_answer, grade, grade_batch, math_reward

WORKED = ("We need $x$ such that $2x + 3 = 4$.\nSubtracting 3 gives $2x = 1$, so\n"
          "$$x = \\dfrac{1}{2}.$$\nTherefore the final answer is $\\boxed{\\dfrac{1}{2}}$.")


@pytest.mark.parametrize("response,label,expected", [
    (WORKED, "\\frac{1}{2}", 1.0),
    (WORKED, "0.5", 1.0),
    (WORKED, "\\frac{1}{3}", 0.0),
    ("The sum of the angles gives $\\boxed{90^\\circ}$.", "90", 1.0),
    ("Angle is \\boxed{45^{\\circ}}", "45^\\circ", 1.0),
    ("The rate rose by $\\boxed{25\\%}$.", "25", 1.0),
    ("So $x \\in \\boxed{[1, 2)}$", "[1,2)", 1.0),
    ("So $x \\in \\boxed{(1, 2]}$", "[1,2)", 0.0),
    ("$\\boxed{\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}}$",
     "\\begin{pmatrix}1\\\\-2\\end{pmatrix}", 1.0),
    ("$\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}$",
     "\\begin{pmatrix}1\\\\-2\\end{pmatrix}", 0.0),
    ("The day is \\boxed{\\text{Monday}}.", "\\text{Monday}", 1.0),
    ("The correct option is \\boxed{\\text{(C)}}", "C", 1.0),
    ("Roots: \\boxed{3, -1}", "-1, 3", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("First I got \\boxed{12}, but rechecking, the answer is \\boxed{13}.", "13", 1.0),
    ("First I got \\boxed{12}, but rechecking, the answer is \\boxed{13}.", "12", 0.0),
    ("Hence the answer is 7.", "7", 1.0),
    ("I computed 3 + 4 = 7 and stopped", "7", 0.0),  # no last-number fallback
    ("\\boxed{x = 3}", "3", 1.0),
    ("\\boxed 5", "5", 1.0),
])
def test_math_reward_realistic(response, label, expected):
    assert math_reward(response, label) == expected


@pytest.mark.parametrize("response", [
    "", "   ", "\\boxed{}", "\\boxed{\\frac{1}{2", "}}}{{{\\boxed{{{", "\\boxed{\\frac{}{}}",
    "\x00\x01\\boxed{\ud800}", "\\boxed{\\begin{pmatrix}1 & \\end{pmatrix}}",
])
def test_garbage_scores_zero_without_raising(response):
    assert math_reward(response, "1") == 0.0


def test_non_string_inputs_score_zero():
    assert math_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert math_reward("\\boxed{1}", None) == 0.0  # type: ignore[arg-type]
    assert math_reward("\\boxed{1}", "") == 0.0


@pytest.fixture
def no_sympy(monkeypatch):
    """Fails the test if an answer goes to a grading process (to sympy)."""
    def sent(pairs, *args):
        pytest.fail(f"sent to a grading process: {pairs}")

    monkeypatch.setattr(reward, "_graded_by_workers", sent)


@pytest.mark.parametrize("answer", ["10^{10^{10}}", "9^9^9", "2^{1000000000}", "100000!"])
def test_explosive_answers_are_not_evaluated(answer, no_sympy):
    assert grade(f"\\boxed{{{answer}}}", "1") == Grade(0.0, answer)
    assert grade(f"\\boxed{{{answer}}}", answer).score == 1.0  # string match still works


def test_huge_response_reads_only_the_tail(monkeypatch, no_sympy):
    searched = []
    boxed = reward.last_boxed
    monkeypatch.setattr(reward, "last_boxed", lambda text: searched.append(len(text)) or
                        boxed(text))
    response = "x = 1. " * 200_000 + "\\boxed{17}"
    assert grade(response, "17") == Grade(1.0, "17")
    assert searched == [reward.TAIL_CHARS]
    assert extract_answer("\\boxed{99}" + " filler" * 2000) == ""  # beyond the tail


def test_grading_works_off_main_thread():
    out = []
    worker = threading.Thread(target=lambda: out.append(math_reward(WORKED, "0.5")))
    worker.start()
    worker.join(10)
    assert out == [1.0]


def test_grade_batch_stats():
    responses = [WORKED, "\\boxed{3}", "no idea", "\\boxed{4}"]
    grades, stats = grade_batch(responses, ["1/2", "3", "5", "5"])
    assert [g.score for g in grades] == [1.0, 1.0, 0.0, 0.0]
    assert [g.answer for g in grades] == ["\\dfrac{1}{2}", "3", "", "4"]
    assert stats["accuracy"] == 0.5 and stats["timeouts"] == 0 and stats["no_answer"] == 1
    with pytest.raises(ValueError, match="2 responses but 1 labels"):
        grade_batch(["a", "b"], ["1"])


def test_grade_batch_over_three_processes_matches_one():
    responses = [WORKED, "\\boxed{3}", "no idea", "\\boxed{4}", "the answer is 5."] * 16
    labels = ["1/2", "3", "5", "5", "5"] * 16
    serial, serial_stats = grade_batch(responses, labels, workers=1)
    reward._outcomes.items.clear()  # graded again, not read back
    pooled, pooled_stats = grade_batch(responses, labels, workers=3)
    assert reward._pool is not None and len(reward._pool.workers) >= 3
    assert [(g.score, g.answer) for g in pooled] == [(g.score, g.answer) for g in serial]
    assert [g.score for g in pooled[:5]] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert pooled_stats["accuracy"] == serial_stats["accuracy"] == 0.6
    assert pooled_stats["no_answer"] == 16


@pytest.mark.parametrize("answer,label,expected", [
    ("243 - 18", "225", 0.0),  # the question's own expression, boxed: not an answer
    ("12 \\times 11", "132", 0.0),
    ("(-3) + 5", "2", 0.0),
    ("6 \\div 2", "3", 0.0),
    ("225", "225", 1.0),
    ("2 \\times 4 = 8", "8", 1.0),  # worked, then the value: still graded by math-verify
    ("2^{10}", "1024", 1.0),
    ("\\frac{6}{2}", "3", 1.0),
    ("1 + \\sqrt{2}", "1+\\sqrt{2}", 1.0),  # non-integer labels are unaffected
    ("1/2", "0.5", 1.0),
])
def test_unevaluated_arithmetic_is_not_a_final_answer(answer, label, expected):
    assert math_reward(f"So the result is \\boxed{{{answer}}}.", label) == expected
