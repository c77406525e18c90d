"""Math benchmark readers and the registry of the paper's evaluation protocol.

The benchmark files (DATA_DIR/NAME/test.jsonl, the layout of the Qwen2.5-Math evaluation
harness that SimpleRL-Zoo ships as simplelr_math_eval/data) name their fields differently
per benchmark: the question may be `question` or `problem`, and the answer may be a field,
the text after gsm8k's "####", the last \\boxed{} of minerva's solution, or olympiadbench's
list of final answers. Each reader turns one row into (question, answer) the way that
harness does, so scores stay comparable with the paper's. Every problem of a run is read
before any generation, and a bad name, file or row raises BenchmarkError naming it.
Generated benchmarks (arithmetic: held-out problems of minisparse.data.synthetic, never in its
training rows) need no file; their problems follow a Difficulty (the data.synthetic_* keys),
so a run trained on one difficulty is scored on held-out problems of the same kind.
A training file (a name ending in .jsonl: {prompt, label} rows as data.path reads them) is
scored with each row's own prompt, as training renders it: how often the model already
solves its training problems at the training temperature says whether GRPO has signal.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from minisparse.data.reward import last_boxed
from minisparse.data.synthetic import Difficulty, distinct_problems

# The seven benchmarks the Sparse-RL paper reports, in its table order.
PAPER_BENCHMARKS: tuple[str, ...] = (
    "gsm8k", "math500", "minerva_math", "olympiadbench", "aime24", "amc23", "gaokao2023en",
)


# Where the benchmark files come from (docs/eval.md); named when data_dir is missing.
EVAL_DATA_HINT = (
    "the files are examples/simplelr_math_eval/data/NAME/test.jsonl of "
    "https://github.com/hkust-nlp/simpleRL-reason: git clone --depth 1 "
    "https://github.com/hkust-nlp/simpleRL-reason && mkdir -p data && "
    "cp -r simpleRL-reason/examples/simplelr_math_eval/data data/eval"
)


ARITHMETIC_SEED = 1234  # the held-out split is fixed; the seed only orders it


class BenchmarkError(ValueError):
    """A benchmark that cannot be evaluated: unknown name, missing file or malformed row."""


class _RowError(ValueError):
    """A row without the fields its reader needs (wrapped into BenchmarkError with file:line)."""


@dataclass(frozen=True)
class Problem:
    benchmark: str
    index: int  # 0-based row number in the benchmark file
    question: str
    answer: str  # ground truth as the grader receives it
    # A training file's prompt as its row holds it (a string, or chat messages), rendered
    # as training renders it; None: the question goes through eval's prompt template.
    prompt: str | list[dict[str, str]] | None = None


@dataclass(frozen=True)
class BenchmarkSpec:
    """A reader plus the paper's sampling protocol for this benchmark."""

    name: str
    reader: Callable[[dict], tuple[str, str]] | None  # None for a generated benchmark
    n_samples: int = 1
    max_new_tokens: int = 8192
    # No file: n problems of a difficulty (benchmarks that have none ignore it).
    generate: Callable[[int, Difficulty], list[tuple[str, str]]] | None = None
    size: int = 0  # problems of a generated benchmark when no limit is given


def _text(row: dict, *keys: str) -> str:
    """The first of `keys` holding a non-empty string (files differ in which they use)."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise _RowError(f"no non-empty string field {' or '.join(repr(k) for k in keys)}")


def _scalar_answer(row: dict, key: str) -> str:
    """A string or number answer as text; amc23 stores 27.0 for 27. An empty string is
    kept (gaokao2023en has two such rows; the harness scores them, always wrong)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _RowError(f"field {key!r} must be a string or number, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def read_gsm8k(row: dict) -> tuple[str, str]:
    solution = _text(row, "answer")
    if "####" not in solution:
        raise _RowError("field 'answer' has no '####' final answer")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise _RowError("nothing after '####' in field 'answer'")
    return _text(row, "question"), answer


def read_math500(row: dict) -> tuple[str, str]:
    return _text(row, "problem"), _scalar_answer(row, "answer")


def read_minerva_math(row: dict) -> tuple[str, str]:
    answer = last_boxed(_text(row, "solution"))
    if not answer:
        raise _RowError("field 'solution' has no \\boxed{} answer")
    return _text(row, "problem"), answer


def read_olympiadbench(row: dict) -> tuple[str, str]:
    finals = row.get("final_answer")
    if not isinstance(finals, list) or not finals or not all(
        isinstance(f, str) and f.strip("$ ") for f in finals
    ):
        raise _RowError(f"field 'final_answer' must be a non-empty list of strings, got {finals!r}")
    return _text(row, "question"), ", ".join(f.strip().strip("$").strip() for f in finals)


def read_aime24(row: dict) -> tuple[str, str]:
    return _text(row, "problem", "question"), _scalar_answer(row, "answer")


def read_amc23(row: dict) -> tuple[str, str]:
    return _text(row, "question", "problem"), _scalar_answer(row, "answer")


def read_gaokao2023en(row: dict) -> tuple[str, str]:
    return _text(row, "question"), _scalar_answer(row, "answer").replace("$", "").strip()


REGISTRY: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec("gsm8k", read_gsm8k),
        BenchmarkSpec("math500", read_math500),
        BenchmarkSpec("minerva_math", read_minerva_math),
        BenchmarkSpec("olympiadbench", read_olympiadbench),
        BenchmarkSpec("aime24", read_aime24, n_samples=32, max_new_tokens=16384),
        BenchmarkSpec("amc23", read_amc23, n_samples=32, max_new_tokens=16384),
        BenchmarkSpec("gaokao2023en", read_gaokao2023en),
        BenchmarkSpec("arithmetic", None, n_samples=4, max_new_tokens=1024, size=500,
                      generate=lambda n, level: distinct_problems(n, ARITHMETIC_SEED, "heldout",
                                                                    level)),
    )
}


# A training file's protocol: one sample of up to 8,192 tokens, like the paper's others.
TRAINING_FILE = BenchmarkSpec("training file", None)


def is_training_file(name: str) -> bool:
    return name.endswith(".jsonl")


def benchmark_key(name: str) -> str:
    """The name results are filed under: a training file's stem, else the name itself."""
    return Path(name).stem if is_training_file(name) else name


def get_spec(name: str) -> BenchmarkSpec:
    if is_training_file(name):
        return TRAINING_FILE
    if name not in REGISTRY:
        raise BenchmarkError(
            f"unknown benchmark '{name}'; known benchmarks: {', '.join(REGISTRY)}, "
            f"or a training file (PATH.jsonl)"
        )
    return REGISTRY[name]


def benchmark_path(name: str, data_dir: str | Path) -> Path:
    return Path(data_dir) / name / "test.jsonl"


def _question_with_hint(question: str, answer: str) -> str:
    """The harness tells the model when a yes/no or true/false answer is expected."""
    if answer.lower() in ("true", "false"):
        return question + " (True or False)"
    if answer.lower() in ("yes", "no"):
        return question + " (Yes or No)"
    return question


def load_training_file(path: str, limit: int | None = None) -> list[Problem]:
    """The first `limit` usable rows of a training file, each with its own prompt; rows
    training would leave out (no label, no prompt) are left out here too."""
    from minisparse.data.datasets import DataError, read_rows

    key = benchmark_key(path)
    if key in REGISTRY:
        raise BenchmarkError(f"training file {path}: its name '{key}' is a benchmark's; "
                             f"rename the file")
    problems: list[Problem] = []
    try:
        for prompt, label in read_rows(path):
            if limit is not None and len(problems) >= limit:
                break
            question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            problems.append(Problem(key, len(problems), question, label, prompt))
    except DataError as exc:
        raise BenchmarkError(f"training file {path}: {exc}") from None
    if not problems:
        raise BenchmarkError(f"training file {path} has no usable rows")
    return problems


def load_benchmark(name: str, data_dir: str | Path, limit: int | None = None,
                   level: Difficulty = Difficulty()) -> list[Problem]:
    """The first `limit` problems (all when None) of one benchmark; BenchmarkError if bad.
    level: the difficulty of a generated benchmark's problems."""
    if is_training_file(name):
        return load_training_file(name, limit)
    spec = get_spec(name)
    if spec.generate is not None:
        try:
            pairs = spec.generate(spec.size if limit is None else limit, level)
        except ValueError as exc:  # a difficulty that leaves the held-out split empty
            raise BenchmarkError(f"benchmark '{name}': {exc}") from None
        return [Problem(name, i, q, a) for i, (q, a) in enumerate(pairs)]
    path = benchmark_path(name, data_dir)
    if not path.is_file():
        hint = "" if Path(data_dir).is_dir() else f" (no directory {data_dir}; {EVAL_DATA_HINT})"
        raise BenchmarkError(f"benchmark '{name}': file {path} not found{hint}")
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise _RowError(f"expected a JSON object, got {type(row).__name__}")
                question, answer = spec.reader(row)
            except (json.JSONDecodeError, _RowError) as exc:
                raise BenchmarkError(f"benchmark '{name}': {path}:{lineno}: {exc}") from None
            question = _question_with_hint(question, answer)
            problems.append(Problem(name, len(problems), question, answer))
    if not problems:
        raise BenchmarkError(f"benchmark '{name}': file {path} has no rows")
    return problems


def parse_benchmark_names(text: str | Sequence[str] | None) -> list[str]:
    """'a,b' or ['a', 'b'] -> validated, de-duplicated names; empty -> the paper's seven."""
    items = text.split(",") if isinstance(text, str) else list(text or [])
    names = list(dict.fromkeys(n.strip() for n in items if n.strip()))
    for name in names:
        get_spec(name)
    return names or list(PAPER_BENCHMARKS)


def load_benchmarks(
    names: Sequence[str], data_dir: str | Path, limit: int | None = None,
    level: Difficulty = Difficulty(),
) -> dict[str, list[Problem]]:
    """Every named benchmark, read in full before any generation starts (level: the
    generated ones' difficulty)."""
    return {benchmark_key(name): load_benchmark(name, data_dir, limit, level)
            for name in parse_benchmark_names(names)}
