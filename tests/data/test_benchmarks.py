"""Readers on hand-written rows in each benchmark's file layout, and the error paths."""
import json
import os
from pathlib import Path

import pytest

from minisparse.data.benchmarks import (
    PAPER_BENCHMARKS,
    BenchmarkError,
    load_benchmark,
    load_benchmarks,
    get_spec,
    parse_benchmark_names,
)
from minisparse.data.reward import last_boxed
from minisparse.data.synthetic import Difficulty

# One made-up row per benchmark, in the layout of its real test.jsonl.
ROWS = {
    "gsm8k": {"question": "Tom has 3 boxes of 400 pens. How many pens?",
              "answer": "3 * 400 = <<3*400=1200>>1200\n#### 1,200", "idx": 0},
    "math500": {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?",
                "solution": "It is $\\boxed{\\frac{3}{4}}$.", "answer": "\\frac{3}{4}",
                "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
    "minerva_math": {"problem": "Find the mass in kg.",
                     "solution": "First $\\boxed{2}$ is wrong; m = \\boxed{\\frac{1}{2}} kg",
                     "type": "Physics", "idx": 0},
    "olympiadbench": {"id": 7, "subfield": "Algebra", "context": None,
                      "question": "Find all x with x^2 = 4.", "solution": ["..."],
                      "final_answer": ["$2$", "$-2$"], "is_multiple_answer": True,
                      "unit": None, "answer_type": "Numerical", "error": None},
    "aime24": {"id": 60, "problem": "Find the remainder of 1000 by 7.",
               "solution": "...", "answer": "6", "url": "u",
               "question": "Find the remainder of 1000 by 7."},
    "amc23": {"id": 0, "problem": "What is 9 times 3?", "answer": 27.0, "url": "u",
              "question": "What is 9 times 3?"},
    "gaokao2023en": {"source": "s", "question": "Is 7 prime?", "lang": "en",
                     "answer": "$\\text{Yes}$"},
}

EXPECTED = {
    "gsm8k": ("Tom has 3 boxes of 400 pens. How many pens?", "1200"),
    "math500": ("What is $\\frac{1}{2}+\\frac{1}{4}$?", "\\frac{3}{4}"),
    "minerva_math": ("Find the mass in kg.", "\\frac{1}{2}"),
    "olympiadbench": ("Find all x with x^2 = 4.", "2, -2"),
    "aime24": ("Find the remainder of 1000 by 7.", "6"),
    "amc23": ("What is 9 times 3?", "27"),
    "gaokao2023en": ("Is 7 prime?", "\\text{Yes}"),
}


def write_bench(data_dir: Path, name: str, rows: list, raw_lines: list[str] = ()) -> Path:
    path = data_dir / name / "test.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name", PAPER_BENCHMARKS)
def test_reader_on_layout_row(tmp_path, name):
    write_bench(tmp_path, name, [ROWS[name]])
    [problem] = load_benchmark(name, tmp_path)
    assert (problem.question, problem.answer) == EXPECTED[name]
    assert (problem.benchmark, problem.index) == (name, 0)


def test_aime_question_field_only(tmp_path):
    write_bench(tmp_path, "aime24", [{"question": "Q?", "answer": 33}])
    assert load_benchmark("aime24", tmp_path)[0].answer == "33"


def test_empty_answer_is_kept_as_unsolvable(tmp_path):
    rows = [{"question": "Q", "answer": ""}, {"question": "R", "answer": None}]
    write_bench(tmp_path, "gaokao2023en", rows)
    with pytest.raises(BenchmarkError, match="test.jsonl:2: field 'answer' must be a string"):
        load_benchmark("gaokao2023en", tmp_path)
    assert load_benchmark("gaokao2023en", tmp_path, limit=1)[0].answer == ""


def test_yes_no_answer_gets_harness_hint(tmp_path):
    write_bench(tmp_path, "math500", [{"problem": "Is 4 even?", "answer": "Yes"}])
    assert load_benchmark("math500", tmp_path)[0].question == "Is 4 even? (Yes or No)"


def test_limit_and_blank_lines(tmp_path):
    rows = [{"problem": f"P{i}", "answer": str(i)} for i in range(5)]
    path = write_bench(tmp_path, "math500", rows[:2])
    path.write_text(path.read_text() + "\n" + "\n".join(json.dumps(r) for r in rows[2:]) + "\n")
    problems = load_benchmark("math500", tmp_path, limit=3)
    assert [(p.index, p.answer) for p in problems] == [(0, "0"), (1, "1"), (2, "2")]
    assert len(load_benchmark("math500", tmp_path)) == 5


def test_last_boxed_nested_and_missing():
    assert last_boxed("a \\boxed{x^{2}} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_unknown_benchmark_is_named():
    with pytest.raises(BenchmarkError, match="unknown benchmark 'gsm9k'"):
        parse_benchmark_names("gsm8k,gsm9k")


def test_names_default_and_dedup():
    assert parse_benchmark_names("") == list(PAPER_BENCHMARKS)
    assert parse_benchmark_names(" amc23 , gsm8k,amc23") == ["amc23", "gsm8k"]


def test_missing_file_names_path(tmp_path):
    with pytest.raises(BenchmarkError, match=r"'amc23': file .*amc23/test.jsonl not found$"):
        load_benchmarks(["amc23"], tmp_path)


def test_missing_data_dir_says_where_the_files_come_from(tmp_path):
    with pytest.raises(BenchmarkError) as info:
        load_benchmarks(["amc23"], tmp_path / "eval")
    assert f"(no directory {tmp_path / 'eval'}; " in str(info.value)
    assert "simpleRL-reason/examples/simplelr_math_eval/data data/eval" in str(info.value)


@pytest.mark.parametrize(
    "name,row,message",
    [
        ("gsm8k", {"question": "q", "answer": "no final answer"}, "no '####'"),
        ("minerva_math", {"problem": "q", "solution": "x = 2"}, "no \\\\boxed"),
        ("olympiadbench", {"question": "q", "final_answer": "2"}, "final_answer"),
        ("amc23", {"question": "q"}, "'answer'"),
        ("math500", {"question": "q", "answer": "1"}, "'problem'"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, name, row, message):
    write_bench(tmp_path, name, [ROWS[name], row])
    with pytest.raises(BenchmarkError, match=f"benchmark '{name}': .*test.jsonl:2: .*{message}"):
        load_benchmark(name, tmp_path)


def test_bad_json_and_empty_file(tmp_path):
    write_bench(tmp_path, "aime24", [ROWS["aime24"]], raw_lines=["{not json"])
    with pytest.raises(BenchmarkError, match=r"test.jsonl:2: .*"):
        load_benchmark("aime24", tmp_path)
    (tmp_path / "amc23").mkdir()
    (tmp_path / "amc23" / "test.jsonl").write_text("\n")
    with pytest.raises(BenchmarkError, match="has no rows"):
        load_benchmark("amc23", tmp_path)


REAL_DATA = Path(os.environ.get("MINISPARSE_EVAL_DATA", "/work/shared/data/eval"))


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason="real benchmark files not present")
def test_real_files_read_completely():
    sizes = {name: len(load_benchmark(name, REAL_DATA)) for name in PAPER_BENCHMARKS}
    assert sizes == {"gsm8k": 1319, "math500": 500, "minerva_math": 272, "olympiadbench": 675,
                     "aime24": 30, "amc23": 40, "gaokao2023en": 385}


def test_arithmetic_is_generated_held_out_and_needs_no_file(tmp_path):
    from minisparse.data.synthetic import synthetic_rows, user_prompt

    problems = load_benchmarks(["arithmetic"], tmp_path / "nowhere")["arithmetic"]
    assert len(problems) == get_spec("arithmetic").size == 500
    assert [p.index for p in problems] == list(range(500))
    assert load_benchmarks(["arithmetic"], tmp_path, limit=7)["arithmetic"] == problems[:7]
    training = {r["prompt"] for r in synthetic_rows(5000, seed=0)}
    assert not training & {user_prompt(p.question) for p in problems}
    assert sum(str(eval(p.question[9:-2].replace("\\times", "*"))) == p.answer
               for p in problems) == 500


def test_arithmetic_at_a_difficulty_stays_held_out(tmp_path):
    from minisparse.data.synthetic import Difficulty, split_of, synthetic_rows, user_prompt

    level = Difficulty(20, ("+", "-"), 1)
    problems = load_benchmark("arithmetic", tmp_path, 50, level)
    exprs = [p.question[len("What is $"):-2] for p in problems]
    assert all(split_of(e) == "heldout" for e in exprs)
    assert all(int(n) <= 20 for e in exprs for n in e.split()[::2])
    training = {r["prompt"] for r in synthetic_rows(2000, 0, level)}
    assert not training & {user_prompt(p.question) for p in problems}
    with pytest.raises(BenchmarkError, match="benchmark 'arithmetic': no heldout problem"):
        load_benchmark("arithmetic", tmp_path, 5, Difficulty(1, ("+",), 1))  # "1 + 1": train


def test_arithmetic_holds_distinct_problems_however_few_the_difficulty_has(tmp_path):
    """9 + 9 sums have 11 held-out problems: a limit of 50 gives those 11, once each, so
    the problem count eval reports is the number of different problems scored."""
    level = Difficulty(9, ("+",), 1)
    problems = load_benchmarks(["arithmetic"], tmp_path, limit=50, level=level)["arithmetic"]
    questions = [p.question for p in problems]
    assert len(questions) == len(set(questions)) == 11
