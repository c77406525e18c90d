"""Rule-based math reward: 1.0 when the response's final answer equals the label.

Answer extraction (documented choice): the last \\boxed{...} (or \\fbox{...}) in the
response; if there is none, the last "answer is X" phrase. There is no last-number
fallback: in RL it would reward unformatted guesses and teach the policy to stop
boxing. Only the response's tail is read, since the final answer is at the end and
sympy's cost grows with input size.

Grading never raises and is bounded in time wherever it runs (main thread, a thread,
an eval worker): answers that only sympy can judge go to grading processes
(grading_pool.py) that stop an answer at `timeout_s` (reward.timeout_s) and are killed
just past it when sympy's C arithmetic ignores the alarm. Outcomes, timeouts included,
are remembered per (answer, label), so a repeated pathological answer costs one timeout;
a batch has a budget (batch_budget_s) after which the answers not yet graded score 0.
Answers whose evaluation could only blow up (towers of powers, huge exponents or
factorials) are compared as strings without sympy.
"""
from __future__ import annotations

import atexit
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minisparse.data.grading_pool import GradingPool
from minisparse.utils.threads import allowed_cpus, physical_cores

TAIL_CHARS = 4096  # only the end of a response is searched for the answer
MAX_ANSWER_CHARS = 512  # longer "answers" are not final answers; graded as strings
DEFAULT_TIMEOUT_S = 2.0  # reward.timeout_s's default
CACHE_SIZE = 65536  # (answer, label) outcomes remembered
# A batch's budget (batch_budget_s): this many per-answer limits per worker, plus this
# much per answer sent to the workers (~10x a typical answer's math-verify time).
BUDGET_TIMEOUTS = 4
BUDGET_PER_ANSWER_S = 0.02
MAX_CHOSEN_WORKERS = 8  # reward.workers 0 takes at most this many grading processes

@dataclass(frozen=True)
class Grade:
    score: float
    answer: str  # the extracted final answer, "" when none was found
    timed_out: bool = False  # no verdict in time (scored 0): its limit, or the batch's
    over_budget: bool = False  # not graded at all: the batch's budget had run out


# ------------------------------------------------------------------ extraction
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", re.IGNORECASE)


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start], None when unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last non-empty \\boxed{...} / \\fbox{...} (braces matched; also
    "\\boxed 5"), None when there is none. Also reads the benchmarks' reference solutions."""
    for match in reversed(list(_BOXED.finditer(text))):
        end = match.end()
        if end < len(text) and text[end] == "{":
            content = _braced(text, end)
        else:  # "\boxed 5"
            content = text[end:].split(maxsplit=1)[0].rstrip("$.") if text[end:].strip() else None
        if content is not None and content.strip():
            return content.strip()
    return None


def extract_answer(response: str) -> str:
    """The final answer of a response ("" when none); see the module docstring."""
    tail = response[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is not None:
        return boxed
    phrases = _ANSWER_IS.findall(tail)
    return phrases[-1].strip().strip("$").strip() if phrases else ""


# ------------------------------------------------------------------ comparison
_STRIP = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\displaystyle|\s|\$")


def _normalize(text: str) -> str:
    text = _STRIP.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\\text\{([^{}]*)\}", r"\1", text).rstrip(".").lower()


_RISKY = (
    re.compile(r"\^\s*\{[^{}]*\^"),  # a power inside an exponent: 10^{10^{10}}
    re.compile(r"\^\s*\(?\s*[\d.]+\s*\)?\s*\^"),  # 9^9^9
    re.compile(r"\^\s*\{?\s*\d{5,}"),  # exponent >= 10000
    re.compile(r"\d{4,}\s*!"),  # 1000!
    re.compile(r"\*\*"),
)


def _risky(text: str) -> bool:
    return len(text) > MAX_ANSWER_CHARS or any(p.search(text) for p in _RISKY)


_INTEGER = re.compile(r"-?\d+")
# integers joined by + - * / x, and nothing else: "243 - 18", "12 \times 11"
_NUMBERS_AND_OPS = re.compile(
    r"\(?-?\d+\)?(?:(?:\+|-|\*|/|\\times|\\cdot|\\div)\(?-?\d+\)?)+")


def _unevaluated(answer: str, label: str) -> bool:
    """An integer label answered with the arithmetic still to do ("243 - 18" for 225).
    math-verify evaluates it and calls it equal, so a policy learns to box the question's
    own expression (SmolLM2 on the arithmetic set did, docs/results.md); it is not a
    final answer. Anything else (powers, fractions, "2 \times 4 = 8") is left to verify."""
    return bool(_INTEGER.fullmatch(_normalize(label))
                and _NUMBERS_AND_OPS.fullmatch(_normalize(answer)))


def _settled(answer: str, label: str) -> bool | None:
    """The verdicts that need no sympy (string checks, bounded by the answer's length),
    given in the calling process; None: math-verify must judge, in a grading process."""
    if _normalize(answer) == _normalize(label):
        return True
    if _unevaluated(answer, label) or _risky(answer) or _risky(label):
        return False
    return None


# ------------------------------------------------------------------ outcomes and budget
class _Outcomes:
    """Grades that took math-verify, by (answer, label), least recently used dropped past
    CACHE_SIZE. Timeouts are kept too (32 copies of a pathological answer cost one
    timeout), each with its limit: reused only under a limit no longer than that."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: OrderedDict[tuple[str, str], tuple[Grade, float]] = OrderedDict()

    def get(self, pair: tuple[str, str], timeout_s: float) -> Grade | None:
        grade, limit = self.items.get(pair, (None, 0.0))
        if grade is None or (grade.timed_out and limit < timeout_s):
            return None
        self.items.move_to_end(pair)
        return grade

    def put(self, pair: tuple[str, str], grade: Grade, timeout_s: float) -> None:
        self.items[pair] = (grade, timeout_s)
        self.items.move_to_end(pair)
        if len(self.items) > self.size:
            self.items.popitem(last=False)


_outcomes = _Outcomes(CACHE_SIZE)
_pool: GradingPool | None = None
_lock = threading.Lock()  # one batch at a time uses the pool and the cache


def batch_budget_s(answers: int, timeout_s: float, workers: int) -> float:
    """Seconds the grading processes may spend on one batch's `answers` distinct answers:
    BUDGET_TIMEOUTS limits per worker plus BUDGET_PER_ANSWER_S per answer over the
    workers. What is left unsent then scores 0, so a batch's grading takes at most this
    plus one limit and KILL_GRACE_S, however many pathological answers it holds."""
    return timeout_s * BUDGET_TIMEOUTS + answers * BUDGET_PER_ANSWER_S / workers


def _grading_pool() -> GradingPool:
    """This process's grading processes, started on first use and kept for the run (a
    forked child starts its own)."""
    global _pool
    if _pool is None or _pool.owner != os.getpid():
        _pool = GradingPool()
        atexit.register(_pool.close)
    return _pool


# ------------------------------------------------------------------ public API
def _answer_and_label(response: Any, label: Any) -> tuple[str, str]:
    """What is compared: the response's final answer and the stripped label ("" where
    either is missing or not text, which scores 0 rather than raising)."""
    try:
        answer = extract_answer(response) if isinstance(response, str) else ""
    except Exception:  # noqa: BLE001 - a reward must never crash the trainer
        answer = ""
    return answer, label.strip() if isinstance(label, str) else ""


def _graded_here(answer: str, label: str, timeout_s: float) -> Grade | None:
    """The grade when it needs no grading process (no answer, a string verdict, a cached
    outcome); None otherwise."""
    if not answer or not label:
        return Grade(0.0, answer)
    verdict = _settled(answer, label)
    if verdict is not None:
        return Grade(float(verdict), answer)
    return _outcomes.get((answer, label), timeout_s)


def _graded_by_workers(pairs: list[tuple[str, str]], timeout_s: float,
                       workers: int) -> dict[tuple[str, str], Grade]:
    """Each distinct pair once, in the grading processes, within the batch's budget."""
    budget = batch_budget_s(len(pairs), timeout_s, workers)
    verdicts = _grading_pool().run(pairs, timeout_s, workers, budget)
    grades = {}
    for i, (answer, label) in enumerate(pairs):
        if i not in verdicts:
            grades[answer, label] = Grade(0.0, answer, timed_out=True, over_budget=True)
            continue
        grades[answer, label] = Grade(float(bool(verdicts[i])), answer,
                                      timed_out=verdicts[i] is None)
        _outcomes.put((answer, label), grades[answer, label], timeout_s)
    return grades


def grading_workers(setting: int, cores: int | None = None,
                    local_processes: int | None = None) -> int:
    """The grading processes for reward.workers: the setting where it is > 0, else one
    per two physical cores of this process's share of the host (torchrun starts
    LOCAL_WORLD_SIZE processes on it), at least 1 and at most MAX_CHOSEN_WORKERS. Why:
    a single process graded the 1,024 answers of a real-weight rollout in 5.5-8.9 s, its
    cores idle; half the cores leave the other half to the trainer's own threads."""
    if setting > 0:
        return setting
    cores = physical_cores(allowed_cpus()) if cores is None else cores
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(MAX_CHOSEN_WORKERS, cores // (2 * max(1, local_processes))))


def launch_grading_processes(workers: int = 1) -> None:
    """Start the grading processes grade_batch will use (reward.workers, as there) without
    waiting for them: from the main thread before grading on another (BackgroundGrading)."""
    _grading_pool().launch(grading_workers(workers))


def grade_batch(responses: Sequence[str], labels: Sequence[str],
                timeout_s: float = DEFAULT_TIMEOUT_S,
                workers: int = 1) -> tuple[list[Grade], dict[str, float]]:
    """Grades, in order, plus stats for logging: accuracy, timeouts (no verdict in time),
    over_budget (of those, never graded), responses with no answer. Answers that need
    math-verify go to `workers` grading processes (reward.workers; 0: grading_workers
    chooses), each stopped at timeout_s (reward.timeout_s); see the module docstring."""
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    workers = grading_workers(workers)
    start = time.perf_counter()
    pairs = [_answer_and_label(r, l) for r, l in zip(responses, labels)]
    with _lock:
        # each distinct pair once, in the batch's order (which answers a budget reaches
        # must not depend on hash order)
        known = {p: _graded_here(*p, timeout_s) for p in dict.fromkeys(pairs)}
        todo = [p for p, g in known.items() if g is None]
        if todo:
            known.update(_graded_by_workers(todo, timeout_s, workers))
    grades = [known[p] for p in pairs]
    n = max(len(grades), 1)
    stats = {
        "accuracy": sum(g.score for g in grades) / n,
        "timeouts": sum(g.timed_out for g in grades),
        "over_budget": sum(g.over_budget for g in grades),
        "no_answer": sum(not g.answer for g in grades),
        "grade_s": time.perf_counter() - start,
    }
    return grades, stats


def grade(response: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Score one response (bad input, sympy errors, timeouts -> 0.0); raises only when no
    grading process can start."""
    return grade_batch([response], [label], timeout_s)[0][0]


def math_reward(response: str, label: str) -> float:
    return grade(response, label).score
