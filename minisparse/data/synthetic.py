"""Generated arithmetic problems: a training set that needs no files, and a held-out
benchmark (`--benchmarks arithmetic`) that no training row can be part of.

Answers are integers, so math_reward grades them exactly; the same (n, seed, split)
always gives the same rows, which keeps runs reproducible across machines. Every problem
belongs to exactly one split, decided by a hash of its expression alone (about one in
HELD_OUT_EVERY is held out), so the two splits are disjoint whatever n and seed are.
"""
from __future__ import annotations

import random
import zlib

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HELD_OUT_EVERY = 10
SPLITS = ("train", "heldout")

_OPS = ("+", "-", "*")


def _problem(rng: random.Random) -> tuple[str, int]:
    op = rng.choice(_OPS)
    if op == "*":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"{a} \\times {b}", a * b
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    return (f"{a} + {b}", a + b) if op == "+" else (f"{a} - {b}", a - b)


def split_of(expr: str) -> str:
    """'heldout' or 'train': a fixed function of the expression text."""
    return "heldout" if zlib.crc32(expr.encode()) % HELD_OUT_EVERY == 0 else "train"


def question(expr: str) -> str:
    return f"What is ${expr}$?"


def user_prompt(question_text: str) -> str:
    """The user turn of a training row; eval's "user" template builds the same text."""
    return f"{question_text} {INSTRUCTION}"


def synthetic_problems(n: int, seed: int = 0, split: str = "train") -> list[tuple[str, str]]:
    """n (question, answer) pairs of one split, drawn in a seeded order."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        expr, answer = _problem(rng)
        if split_of(expr) == split:
            out.append((question(expr), str(answer)))
    return out


def synthetic_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n training rows {"prompt", "label"} in the JSONL schema data.py reads."""
    return [{"prompt": user_prompt(q), "label": a} for q, a in synthetic_problems(n, seed)]
