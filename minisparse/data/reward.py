"""Rule-based math reward: 1.0 when the response's final answer equals the label.

Answer extraction (documented choice): the last \\boxed{...} (or \\fbox{...}) in the
response; if there is none, the last "answer is X" phrase. There is no last-number
fallback: in RL it would reward unformatted guesses and teach the policy to stop
boxing. Only the response's tail is read, since the final answer is at the end and
sympy's cost grows with input size.

Grading never raises and is bounded in time: a deadline (SIGALRM interval timer in the
main thread; a watchdog that aborts a helper thread elsewhere) cuts off slow sympy work,
and answers whose evaluation could hang inside C code (towers of powers, huge
exponents or factorials: a signal cannot interrupt those) are compared as strings only.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

TAIL_CHARS = 4096  # only the end of a response is searched for the answer
MAX_ANSWER_CHARS = 512  # longer "answers" are not final answers; graded as strings
DEFAULT_TIMEOUT_S = 2.0

T = TypeVar("T")


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns that its own timeouts are off; ours replace them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


@dataclass
class Grade:
    score: float
    answer: str  # the extracted final answer, "" when none was found
    timed_out: bool = False


class _Deadline(BaseException):
    """BaseException so math-verify's own `except Exception` cannot swallow it."""


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


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple:
    """math-verify parse of a bare answer (labels repeat n_samples times: cached)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    return tuple(parse("\\boxed{" + text + "}", extraction_config=config, parsing_timeout=None))


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


@functools.lru_cache(maxsize=65536)
def _equivalent(answer: str, label: str) -> bool:
    from math_verify import verify

    if _normalize(answer) == _normalize(label):
        return True
    if _unevaluated(answer, label):
        return False
    if _risky(answer) or _risky(label):
        return False
    gold, pred = _parsed(label), _parsed(answer)
    return bool(gold and pred and verify(list(gold), list(pred), timeout_seconds=None))


# ------------------------------------------------------------------ deadlines
def _with_alarm(fn: Callable[[], T], seconds: float) -> T:
    def on_alarm(signum: int, frame: Any) -> None:
        raise _Deadline()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _with_watchdog(fn: Callable[[], T], seconds: float) -> T:
    """Off the main thread signals are unavailable: run fn in a daemon thread and, past
    the deadline, inject an exception into it (takes effect at its next bytecode)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc

    worker = threading.Thread(target=target, daemon=True, name="math-reward")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(worker.ident), ctypes.py_object(_Deadline))
        raise _Deadline()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _run_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    in_main = threading.current_thread() is threading.main_thread()
    return _with_alarm(fn, seconds) if in_main else _with_watchdog(fn, seconds)


# ------------------------------------------------------------------ public API
def grade(response: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Score one response; never raises (bad input, sympy errors, timeouts -> 0.0)."""
    try:
        _warm_up()  # once per process, outside the deadline (see _warm_up)
        answer = extract_answer(response) if isinstance(response, str) else ""
        label = label.strip() if isinstance(label, str) else ""
        if not answer or not label:
            return Grade(0.0, answer)
        ok = _run_with_deadline(lambda: _equivalent(answer, label), timeout_s)
        return Grade(1.0 if ok else 0.0, answer)
    except _Deadline:
        return Grade(0.0, answer, timed_out=True)
    except Exception:  # noqa: BLE001 - a reward must never crash the trainer
        return Grade(0.0, "")


def math_reward(response: str, label: str) -> float:
    return grade(response, label).score


POOL_MIN_BATCH = 64  # smaller batches are graded in-process (a pool round trip costs more)
_pool: Any = None


def _grade_pool(workers: int):
    """One spawned process pool per trainer process, kept for the run. Spawned, not forked:
    the trainer holds CUDA and NCCL state that a forked child must not inherit. Workers run
    grade() in their main thread, so the SIGALRM deadline applies there too."""
    global _pool
    if _pool is None or _pool._max_workers != workers:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_warm_up)
    return _pool


@functools.cache
def _warm_up() -> None:
    """The first grade of a process must not pay for importing math-verify (and sympy)
    under the deadline: an import cut short by the alarm leaves half-initialised modules
    that then grade wrongly for the rest of the process (seen as pooled scores that
    depended on each worker's history: 235 of 1,024 wrong before this warm-up, 0 after)."""
    _parsed.__wrapped__("1")


def _grade_all(pairs: list[tuple[str, str]], timeout_s: float) -> list[Grade]:
    return [grade(r, l, timeout_s) for r, l in pairs]


def grade_batch(responses: Sequence[str], labels: Sequence[str],
                timeout_s: float = DEFAULT_TIMEOUT_S,
                workers: int = 1) -> tuple[list[Grade], dict[str, float]]:
    """Grades plus stats for logging: accuracy, timeouts, responses with no answer.
    Batches of POOL_MIN_BATCH or more are split over `workers` processes (the config's
    reward.workers; 1: in this process), in order."""
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    start = time.perf_counter()
    pairs = list(zip(responses, labels))
    if workers > 1 and len(pairs) >= POOL_MIN_BATCH:
        chunks = [pairs[i::workers] for i in range(workers)]  # interleaved: similar loads
        parts = list(_grade_pool(workers).map(_grade_all, chunks, [timeout_s] * workers))
        grades = [parts[i % workers][i // workers] for i in range(len(pairs))]
    else:
        grades = _grade_all(pairs, timeout_s)
    n = max(len(grades), 1)
    stats = {
        "accuracy": sum(g.score for g in grades) / n,
        "timeouts": sum(g.timed_out for g in grades),
        "no_answer": sum(not g.answer for g in grades),
        "grade_s": time.perf_counter() - start,
    }
    return grades, stats
