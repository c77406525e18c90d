"""Generated arithmetic problems: a dataset the tiny configs can train on with no files.

Answers are integers, so math_reward grades them exactly; the same (n, seed) always
gives the same rows, which keeps tiny runs reproducible across machines.
"""
from __future__ import annotations

import random

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_OPS = ("+", "-", "*")


def _problem(rng: random.Random) -> tuple[str, int]:
    op = rng.choice(_OPS)
    if op == "*":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"{a} \\times {b}", a * b
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    return (f"{a} + {b}", a + b) if op == "+" else (f"{a} - {b}", a - b)


def synthetic_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n rows {"prompt", "label"} in the JSONL schema data.py reads."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        expr, answer = _problem(rng)
        rows.append({"prompt": f"What is ${expr}$? {INSTRUCTION}", "label": str(answer)})
    return rows
