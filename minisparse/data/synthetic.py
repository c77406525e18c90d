"""Generated arithmetic problems: a training set that needs no files, and a held-out
benchmark (`--benchmarks arithmetic`) that no training row can be part of.

Answers are integers, so math_reward grades them exactly; the same (n, seed, split,
difficulty) always gives the same rows, which keeps runs reproducible across machines.
Every problem belongs to exactly one split, decided by a hash of its expression alone
(about one in HELD_OUT_EVERY is held out), so the two splits are disjoint whatever n,
seed and difficulty are.

The difficulty (Difficulty, the data.synthetic_* config keys) sets how large the
operands are, which operators appear and how many operations a problem chains: the
default is the set the SmolLM2 ablation trained on; a small model on a CPU needs an easier
one to earn any reward in its first rollouts (configs/smollm2_cpu.yaml).
"""
from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from itertools import islice
from dataclasses import dataclass

from minisparse.config.schema import DataConfig, Operator, choices

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HELD_OUT_EVERY = 10
SPLITS = ("train", "heldout")
OPERATORS = choices(Operator)
MAX_FACTOR = 30  # largest operand next to a multiplication
MAX_MISSES = 100_000  # draws in a row outside the split before the split counts as empty
REPEATS_DONE = 10_000  # draws in a row that repeat a problem: none new is left to draw

_LATEX = {"+": "+", "-": "-", "*": "\\times"}


@dataclass(frozen=True)
class Difficulty:
    """What a generated problem looks like (the data.synthetic_* config keys)."""
    max_operand: int = 999  # operands of + and - are drawn from 1..max_operand
    operators: tuple[str, ...] = OPERATORS
    operations: int = 1  # operators per problem: 2 gives "a + b - c"

    @classmethod
    def from_config(cls, data: DataConfig) -> Difficulty:
        """From a DataConfig's synthetic_* keys."""
        return cls(data.synthetic_max_operand, tuple(data.synthetic_operators),
                   data.synthetic_operations)


def _operand(rng: random.Random, by_product: bool, max_operand: int) -> int:
    """Factors stay small (2..30, capped at max_operand) so products stay readable."""
    if by_product:
        return rng.randint(min(2, max_operand), min(MAX_FACTOR, max_operand))
    return rng.randint(1, max_operand)


def _problem(rng: random.Random, level: Difficulty = Difficulty()) -> tuple[str, int]:
    """(LaTeX expression, its value under the usual precedence)."""
    ops = [rng.choice(level.operators) for _ in range(level.operations)]
    nums = [_operand(rng, "*" in ops[max(i - 1, 0):i + 1], level.max_operand)
            for i in range(len(ops) + 1)]
    python = " ".join(f"{n} {op}" for n, op in zip(nums, ops)) + f" {nums[-1]}"
    latex = " ".join(f"{n} {_LATEX[op]}" for n, op in zip(nums, ops)) + f" {nums[-1]}"
    return latex, eval(python)  # integers and + - * only, built above


def split_of(expr: str) -> str:
    """'heldout' or 'train': a fixed function of the expression text."""
    return "heldout" if zlib.crc32(expr.encode()) % HELD_OUT_EVERY == 0 else "train"


def question(expr: str) -> str:
    return f"What is ${expr}$?"


def user_prompt(question_text: str) -> str:
    """The user turn of a training row; eval's "user" template builds the same text."""
    return f"{question_text} {INSTRUCTION}"


def _split_stream(seed: int, split: str, level: Difficulty) -> Iterator[tuple[str, str]]:
    """(question, answer) pairs of one split, endlessly, in a seeded order (repeats
    included); ValueError when MAX_MISSES draws in a row miss the split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(seed)
    misses = 0
    while True:
        expr, answer = _problem(rng, level)
        if split_of(expr) != split:
            misses += 1
            if misses == MAX_MISSES:
                raise ValueError(f"no {split} problem in {MAX_MISSES} draws: {level} leaves "
                                 f"too few distinct problems; raise max_operand or operations")
            continue
        misses = 0
        yield question(expr), str(answer)


def synthetic_problems(n: int, seed: int = 0, split: str = "train",
                       level: Difficulty = Difficulty()) -> list[tuple[str, str]]:
    """n (question, answer) pairs of one split, drawn in a seeded order (with repeats when
    the difficulty allows fewer distinct problems than n)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(islice(_split_stream(seed, split, level), n))


def distinct_problems(n: int, seed: int = 0, split: str = "heldout",
                      level: Difficulty = Difficulty()) -> list[tuple[str, str]]:
    """The first n distinct pairs of synthetic_problems' order, fewer when the difficulty
    has fewer (9 + 9 sums hold 8 held-out ones): a benchmark scores each problem once, so
    its count says how many problems were scored, not how many draws."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    seen: dict[str, str] = {}
    repeats = 0
    stream = _split_stream(seed, split, level)
    while len(seen) < n and repeats < REPEATS_DONE:
        q, a = next(stream)
        repeats = repeats + 1 if q in seen else 0
        seen.setdefault(q, a)
    return list(seen.items())


def synthetic_rows(n: int, seed: int = 0,
                   level: Difficulty = Difficulty()) -> list[dict[str, str]]:
    """n training rows {"prompt", "label"} in the JSONL schema data.py reads."""
    return [{"prompt": user_prompt(q), "label": a}
            for q, a in synthetic_problems(n, seed, "train", level)]
