"""The results tables of an ablation, from its runs' metrics.jsonl, as Markdown:
`python -m minisparse.plot RUN_DIR... --group --table`.

Held-out accuracy: per variant (a group of seeds, see plot.group_runs), the in-training
evaluation's accuracy (eval/average_accuracy) at each rollout that every run evaluated,
as mean ± standard deviation over the seeds (sample std; "-" with one seed).
Cost: per variant, over the rollouts every run of every variant has done (so variants are
compared on the same rollouts), each run's mean, then mean ± std over seeds: wall time
per rollout (time/step_s: rollout to update, evaluation and saving left out), rollout
tokens/s, peak KV per sequence (its mean over samples, and the most any sample held),
the share of tokens rejection kept and of sequences the veto dropped, the most KV the
engine held at once, each KV figure also as a share of the dense variant's, and the most
GPU memory the process held in any phase. Runs that share a GPU share its
time, so wall time and tokens/s are those of the runs together.
"""
from __future__ import annotations

import math
from collections.abc import Callable

HELDOUT = "eval/average_accuracy"
INTERVAL = "_ci95"  # eval/BENCHMARK/accuracy_ci95: half-width of one evaluation's 95% interval
DENSE = "dense"  # the variant the KV column divides by, when there is one


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def cell(values: list[float], fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    """'mean ± std' of values (times scale), '-' for no values, the mean alone for one."""
    if not values:
        return "-"
    mean, std = mean_std([v * scale for v in values])
    return fmt.format(mean) + ("" if std is None else " ± " + fmt.format(std))


def eval_rollouts(groups: dict[str, list[list[dict]]]) -> list[int]:
    """The rollouts at which every run of every group logged a held-out accuracy."""
    sets = [{r["rollout"] for r in rows if HELDOUT in r}
            for runs in groups.values() for rows in runs]
    return sorted(set.intersection(*sets)) if sets else []


def common_rollouts(groups: dict[str, list[list[dict]]]) -> int:
    """The last rollout every run has logged (0 when one has none)."""
    return min((max((r["rollout"] for r in rows), default=0)
                for runs in groups.values() for rows in runs), default=0)


def run_mean(rows: list[dict], key: str, upto: int,
             reduce: Callable[[list[float]], float] | None = None) -> float | None:
    """One run's `key` over its rollouts 1..upto: the mean (or `reduce`); None if absent."""
    values = [float(r[key]) for r in rows if key in r and r["rollout"] <= upto]
    if not values:
        return None
    return reduce(values) if reduce else sum(values) / len(values)


def peak_memory(rows: list[dict], upto: int) -> float | None:
    """The most GPU memory (GiB) the run held in any phase: mem/peak_gib, or the largest
    per-phase peak of runs that logged no mem/peak_gib."""
    keys = {k for r in rows for k in r if k.startswith("mem/") and k.endswith("_peak_gib")}
    found = [run_mean(rows, k, upto, max) for k in sorted(keys)]
    return max((v for v in found if v is not None), default=None)


def heldout_table(groups: dict[str, list[list[dict]]]) -> str:
    """Markdown: a row per variant, a column per common evaluation rollout (in %)."""
    at = eval_rollouts(groups)
    if not at:
        return "no rollout at which every run logged eval/average_accuracy"
    lines = ["| variant | seeds | " + " | ".join(f"rollout {r}" for r in at) + " |",
             "|---|---|" + "---|" * len(at)]
    for name, runs in groups.items():
        cells = []
        for r in at:
            cells.append(cell([row[HELDOUT] for rows in runs for row in rows
                               if row["rollout"] == r and HELDOUT in row], scale=100))
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def interval_table(groups: dict[str, list[list[dict]]]) -> str:
    """Markdown: per variant, the half-width of one evaluation's 95% interval over problems
    (in %, the mean over its seeds and benchmarks) at each common evaluation rollout, so a
    gap between variants can be read against what one evaluation can resolve."""
    at = eval_rollouts(groups)
    lines = ["| variant | " + " | ".join(f"rollout {r}" for r in at) + " |",
             "|---|" + "---|" * len(at)]
    for name, runs in groups.items():
        cells = []
        for r in at:
            widths = [v for rows in runs for row in rows if row["rollout"] == r
                      for k, v in row.items() if k.startswith("eval/") and k.endswith(INTERVAL)]
            cells.append("-" if not widths else f"± {100 * sum(widths) / len(widths):.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


COST_COLUMNS: tuple[tuple[str, str, Callable | None, str, float], ...] = (
    # (header, metric, reduce over rollouts (None: mean), format, scale)
    ("training accuracy %", "rollout/accuracy", None, "{:.1f}", 100.0),
    ("response tokens", "rollout/response_len_mean", None, "{:.0f}", 1.0),
    ("s / rollout", "time/step_s", None, "{:.1f}", 1.0),
    ("rollout tokens/s", "perf/rollout_tokens_per_s", None, "{:.0f}", 1.0),
    ("peak KV / seq, mean", "compress/peak_cache_tokens_mean", None, "{:.0f}", 1.0),
    ("peak KV / seq, max", "compress/peak_cache_tokens_max", max, "{:.0f}", 1.0),
    ("compressed-token share", "compress/compressed_token_frac", None, "{:.2f}", 1.0),
    ("mismatch KL (k1)", "mismatch/kl_k1", None, "{:.4f}", 1.0),
    ("kept tokens", "rs/kept_token_frac", None, "{:.2f}", 1.0),
    ("vetoed sequences", "rs/vetoed_frac", None, "{:.2f}", 1.0),
    ("KV held at once, peak", "perf/peak_kv_tokens", max, "{:.0f}", 1.0),
)
# (header, metric, reduce): KV figures also given as a share of the dense variant's
RELATIVE_COLUMNS: tuple[tuple[str, str, Callable | None], ...] = (
    ("KV / dense", "compress/peak_cache_tokens_mean", None),
    ("KV at once / dense", "perf/peak_kv_tokens", max),
)


def dense_mean(groups: dict[str, list[list[dict]]], key: str, upto: int,
               reduce: Callable | None) -> float | None:
    """The dense variant's `key` (each run's mean or reduce, then over its seeds); None
    without a dense variant or the metric."""
    values = [run_mean(rows, key, upto, reduce) for rows in groups.get(DENSE, [])]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def cost_table(groups: dict[str, list[list[dict]]]) -> str:
    """Markdown: a row per variant, the COST_COLUMNS, the RELATIVE_COLUMNS and the GPU
    memory, over the rollouts all runs have done."""
    upto = common_rollouts(groups)
    head = [c[0] for c in COST_COLUMNS] + [c[0] for c in RELATIVE_COLUMNS]
    dense = {key: dense_mean(groups, key, upto, reduce) for _, key, reduce in RELATIVE_COLUMNS}
    lines = [f"over rollouts 1-{upto}", "",
             "| variant | seeds | " + " | ".join(head) + " | GPU memory GiB |",
             "|---|---|" + "---|" * (len(head) + 1)]
    for name, runs in groups.items():
        cells = []
        for _, key, reduce, fmt, scale in COST_COLUMNS:
            values = [run_mean(rows, key, upto, reduce) for rows in runs]
            cells.append(cell([v for v in values if v is not None], fmt, scale))
        for _, key, reduce in RELATIVE_COLUMNS:
            values = [run_mean(rows, key, upto, reduce) for rows in runs]
            cells.append(cell([v / dense[key] for v in values if v is not None]
                              if dense[key] else [], "{:.2f}"))
        memory = [peak_memory(rows, upto) for rows in runs]
        cells.append(cell([v for v in memory if v is not None], "{:.2f}"))
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


WINDOW_METRICS: tuple[tuple[str, str, str, float], ...] = (
    # (name, metric, format, scale): whether compression acts, and what the run learns
    ("compressed-token share", "compress/compressed_token_frac", "{:.2f}", 1.0),
    ("mismatch KL (k1)", "mismatch/kl_k1", "{:.3f}", 1.0),
    ("training accuracy %", "rollout/accuracy", "{:.1f}", 100.0),
    ("response tokens", "rollout/response_len_mean", "{:.0f}", 1.0),
)


def window_table(groups: dict[str, list[list[dict]]], width: int = 10) -> str:
    """Markdown: per variant and WINDOW_METRICS metric, its mean over each `width`-rollout
    window every run completed (each run's window mean, then mean ± std over seeds): a
    run tests the corrections only while compression acts in every window, not just at
    the start."""
    upto = common_rollouts(groups)
    windows = [(lo, min(lo + width - 1, upto)) for lo in range(1, upto + 1, width)]
    if not windows:
        return "no rollout every run has logged"
    lines = ["| variant | metric | " + " | ".join(f"{a}-{b}" for a, b in windows) + " |",
             "|---|---|" + "---|" * len(windows)]
    for name, runs in groups.items():
        for label, key, fmt, scale in WINDOW_METRICS:
            cells = []
            for lo, hi in windows:
                means = [run_mean([r for r in rows if r["rollout"] >= lo], key, hi)
                         for rows in runs]
                cells.append(cell([v for v in means if v is not None], fmt, scale))
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_tables(groups: dict[str, list[list[dict]]]) -> str:
    """The four tables, headed, ready for docs/results.md."""
    return ("held-out accuracy, % (mean ± std over seeds)\n\n" + heldout_table(groups)
            + "\n\none evaluation's 95% interval, half-width over problems (mean over seeds)"
            "\n\n" + interval_table(groups)
            + "\n\ncost per variant (each run's mean; mean ± std over seeds)\n\n"
            + cost_table(groups)
            + "\n\nper 10-rollout window (each run's mean; mean ± std over seeds)\n\n"
            + window_table(groups) + "\n")
