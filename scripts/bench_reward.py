"""Times grade_batch on 1024 realistic mixed responses (128 prompts x 8 samples, as in
one qwen3b_rkv rollout), in this process and in the process pool; prints the median of
3 runs, each on a new batch (new answers, as in successive rollouts; the pool's workers
keep their caches, as they do during training), after a warm-up batch.

    python scripts/bench_reward.py
"""
from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minisparse import reward  # noqa: E402

# (label, a correct boxed form, a wrong boxed form); K is a per-prompt random integer so
# that, as in real rollouts, answers differ across prompts and caches help only within
# a group of samples.
ANSWERS = [
    ("\\frac{1}{K}", "\\dfrac{1}{K}", "\\frac{2}{K}"),
    ("K.75", "K + \\frac{3}{4}", "K.7"),
    ("K", "K^\\circ", "(K+1)^\\circ"),
    ("K", "K\\%", "(K-1)\\%"),
    ("[1,K)", "[1, K)", "(1, K]"),
    ("\\begin{pmatrix}1\\\\-K\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ -K \\end{pmatrix}",
     "\\begin{pmatrix} K \\\\ -1 \\end{pmatrix}"),
    ("\\text{Monday}", "\\text{Monday}", "\\text{Tuesday}"),
    ("\\frac{\\sqrt{K}}{2}", "\\dfrac{\\sqrt{K}}{2}", "\\sqrt{K}"),
    ("-1, K", "K, -1", "K"),
    ("K", "K", "K1"),
    ("K\\pi", "K\\pi", "\\pi"),
    ("x^2+2 \\cdot K x+K^2", "(x+K)^2", "x^2+K^2"),
]
REASONING = ("Let us compute step by step. First, note that $a + b = 7$ and $ab = 12$, so "
             "$a^2 + b^2 = (a+b)^2 - 2ab = 49 - 24 = 25$.\n\n")


def make_batch(seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, labels = [], []
    for _ in range(128):
        k = str(rng.randint(3, 999))
        label, right, wrong = (t.replace("K", k) for t in rng.choice(ANSWERS))
        for _ in range(8):
            body = REASONING * rng.randint(2, 30)
            kind = rng.random()
            if kind < 0.45:
                tail = f"Therefore the answer is $\\boxed{{{right}}}$."
            elif kind < 0.85:
                tail = f"So we get $\\boxed{{{wrong}}}$."
            elif kind < 0.95:
                tail = "I am not sure how to finish this"  # truncated, no answer
            else:
                tail = f"Maybe \\boxed{{{wrong}}}? No: the answer is \\boxed{{{right}}}."
            responses.append(body + tail)
            labels.append(label)
    return responses, labels


def timed(workers: int) -> str:
    reward._parsed.cache_clear()
    reward._equivalent.cache_clear()
    reward.grade_batch(*make_batch(0), workers=workers)  # warm-up (starts the pool)
    times = []
    for seed in (1, 2, 3):
        responses, labels = make_batch(seed)
        start = time.perf_counter()
        _, stats = reward.grade_batch(responses, labels, workers=workers)
        times.append(time.perf_counter() - start)
    return (f"workers={workers}: median {statistics.median(times):.2f} s (runs "
            f"{', '.join(f'{t:.2f}' for t in times)}), accuracy {stats['accuracy']:.3f}, "
            f"timeouts {stats['timeouts']}")


def main() -> None:
    print(f"grade_batch on 1024 responses, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    for workers in (1, int(os.environ.get("BENCH_WORKERS", "8"))):
        print(timed(workers))


if __name__ == "__main__":
    main()
