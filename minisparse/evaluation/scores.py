"""A benchmark's scores from its graded samples (Sparse-RL paper / Qwen2.5-Math harness):
avg@n (mean accuracy over all samples) with its 95% interval, unbiased pass@k for the
powers of two up to n, lengths, truncation and grading timeouts; and how they are shown
(the training logger's keys, eval.py's table). Two checkpoints compared: paired.py."""
from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def accuracy_ci95(per_problem: Sequence[float]) -> float | None:
    """Half-width of the 95% interval of the mean accuracy, the problems taken as a sample
    of their kind (normal approximation over per-problem accuracies: with n samples a
    problem, c/n each): 0.044 for 500 problems at 50% with one sample each."""
    count = len(per_problem)
    if count < 2:  # no spread to estimate from
        return None
    mean = sum(per_problem) / count
    variance = sum((x - mean) ** 2 for x in per_problem) / (count - 1)
    return 1.96 * math.sqrt(variance / count)


def problem_counts(records: Sequence[dict]) -> dict[int, tuple[int, int]]:
    """problem_index -> (its samples graded right, its samples)."""
    counts: dict[int, tuple[int, int]] = {}
    for r in records:
        right, total = counts.get(r["problem_index"], (0, 0))
        counts[r["problem_index"]] = (right + int(r["correct"]), total + 1)
    return counts


def per_problem_accuracy(records: Sequence[dict]) -> dict[int, float]:
    """problem_index -> the share of its samples graded right."""
    return {index: right / total for index, (right, total) in problem_counts(records).items()}


def pass_k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n."""
    return [2**i for i in range(n.bit_length()) if 2**i <= n]


def sample_metrics(records: Sequence[dict], n_samples: int) -> dict:
    """avg@n, pass@k, length, truncation and timeouts from per-sample records."""
    correct = [right for right, _ in problem_counts(records).values()]
    total = len(records)
    metrics = {
        "problems": len(correct),
        "samples": total,
        "accuracy": sum(int(r["correct"]) for r in records) / total,
        "accuracy_ci95": accuracy_ci95([c / n_samples for c in correct]),
        "pass_at_k": {
            f"pass@{k}": sum(pass_at_k(n_samples, c, k) for c in correct) / len(correct)
            for k in pass_k_values(n_samples)
        },
        "mean_response_tokens": sum(r["tokens"] for r in records) / total,
        "truncated_fraction": sum(r["finish_reason"] == "length" for r in records) / total,
        "grading_timeouts": sum(bool(r["grading_timed_out"]) for r in records),
    }
    if any("num_compressions" in r for r in records):
        metrics["mean_compressions"] = sum(r.get("num_compressions", 0) for r in records) / total
    return metrics


def summarize(settings: dict, results: dict[str, dict]) -> dict:
    """The evaluation's summary: its settings, each benchmark's metrics, their mean accuracy."""
    return {
        "settings": settings,
        "benchmarks": results,
        "average_accuracy": sum(m["accuracy"] for m in results.values()) / max(len(results), 1),
    }


def flat_metrics(summary: dict, prefix: str = "eval") -> dict[str, float]:
    """{'eval/gsm8k/accuracy': ..., 'eval/average_accuracy': ...} for the training logger."""
    flat = {f"{prefix}/average_accuracy": summary["average_accuracy"]}
    for name, m in summary["benchmarks"].items():
        for key in ("accuracy", "accuracy_ci95", "mean_response_tokens", "truncated_fraction"):
            if m.get(key) is not None:  # one problem has no interval; older results none
                flat[f"{prefix}/{name}/{key}"] = m[key]
        for key, value in m["pass_at_k"].items():
            flat[f"{prefix}/{name}/{key}"] = value
    return flat


def percent_with_interval(m: dict, plus_minus: str = "+-") -> str:
    """A benchmark's accuracy in % with its 95% interval where it has one: '40.6 +- 4.3'."""
    ci = m.get("accuracy_ci95")
    return f"{100 * m['accuracy']:.1f}" + ("" if ci is None else f" {plus_minus} {100 * ci:.1f}")


def format_table(summary: dict) -> str:
    """The per-benchmark table eval.py prints."""
    header = ("benchmark", "problems", "n", "avg@n", "pass@max", "mean len", "truncated",
              "timeouts", "gen s", "tok/s")
    rows = [header]
    for name, m in summary["benchmarks"].items():
        best_k = list(m["pass_at_k"])[-1]
        rows.append((
            name, str(m["problems"]), str(m["n_samples"]), percent_with_interval(m),
            f"{100 * m['pass_at_k'][best_k]:.1f} ({best_k})", f"{m['mean_response_tokens']:.0f}",
            f"{100 * m['truncated_fraction']:.1f}%", str(m["grading_timeouts"]),
            f"{m['generation_s']:.1f}", f"{m['tokens_per_s']:.0f}",
        ))
    rows.append(("average", "", "", f"{100 * summary['average_accuracy']:.1f}") + ("",) * 6)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
