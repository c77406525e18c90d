"""A grading process (grading_pool.py starts them): math-verify's verdict on each
(answer, label) it is sent, stopped at the request's limit by SIGALRM in its own main
thread, where the alarm also interrupts sympy's integer arithmetic. C work that ignores
the alarm is the pool's to kill. Run as `python -m minisparse.data.grading_worker`.

A grading process ignores SIGINT: a terminal's Ctrl-C goes to the whole process group,
and the trainer owns the stop (one line, no traceback; trainer/stop.py). The pool kills
its workers at exit (GradingPool.close), the kernel kills them if the trainer dies
(PR_SET_PDEATHSIG), and otherwise a worker ends when its stdin closes."""
from __future__ import annotations

import signal

if __name__ == "__main__":  # first, before any import: Ctrl-C is the trainer's to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns that its own timeouts are off; ours replace them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


class _Deadline(BaseException):
    """BaseException so math-verify's own `except Exception` cannot swallow it."""


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple:
    """math-verify parse of a bare answer (labels repeat n_samples times: cached)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    return tuple(parse("\\boxed{" + text + "}", extraction_config=config, parsing_timeout=None))


def _math_verify(answer: str, label: str) -> bool:
    from math_verify import verify as equal

    gold, pred = _parsed(label), _parsed(answer)
    return bool(gold and pred and equal(list(gold), list(pred), timeout_seconds=None))


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


def verify(answer: str, label: str, timeout_s: float) -> bool | None:
    """math-verify's verdict, run by a grading process in its main thread, where the alarm
    also interrupts sympy's integer arithmetic; None: stopped at timeout_s."""
    try:
        return _with_alarm(lambda: _math_verify(answer, label), timeout_s)
    except _Deadline:
        return None
    except Exception:  # noqa: BLE001 - sympy's errors on odd input: not equal
        return False


@functools.cache
def _warm_up() -> None:
    """A grading process's first answer must not pay for importing math-verify (and sympy)
    under the alarm: an import cut short leaves half-initialised modules that then grade
    wrongly for the rest of the process (seen as pooled scores that depended on each
    worker's history: 235 of 1,024 wrong before this warm-up, 0 after)."""
    _parsed.__wrapped__("1")


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker when the trainer dies, even mid-computation in C (a
    parent_pid of 0: not asked; the worker then ends when its stdin closes)."""
    if not parent_pid:
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        raise SystemExit(0)


def serve(parent_pid: int) -> None:
    """Answer requests on stdin until it closes. Replies go to a private copy of stdout,
    and stdout itself to stderr, so that nothing a library prints can garble them."""
    _die_with_parent(parent_pid)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def say(message: object) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    _warm_up()
    try:
        say("ready")
        for line in sys.stdin:
            say(verify(*json.loads(line)))
    except BrokenPipeError:  # the trainer went without closing us (e.g. a second Ctrl-C):
        os._exit(0)  # nobody to answer; _exit, or the unflushed reply is reported at exit


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
