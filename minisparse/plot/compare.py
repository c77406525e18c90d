"""Each variant of an ablation against the baseline of the same seed, at every checkpoint
the runs evaluated: the tables `python -m minisparse.plot RUN_DIR... --group --table`
prints after the results tables when a group is named dense.

A run's in-training evaluation leaves its graded samples in
RUN_DIR/eval/rollout_NNNNNN/BENCHMARK/samples.jsonl (records cut to problem_index,
sample_index and correct pair as well: scripts/keep_records.py). Where both runs of a
seed kept them, the seed's cell is the paired difference with its 95% interval, and the
seeds pool into one paired test over (seed, problem) pairs (minisparse/evaluation/
paired.py): its two-sided p, its one-sided 95% lower bound and whether that bound clears
the non-inferiority margin. Every checkpoint is reported the same way from the scores in
metrics.jsonl as well (each seed's gap; their mean with the interval of unrelated
scores, wider than the paired one), so one without samples is not left out.
"""
from __future__ import annotations

import re
from pathlib import Path

from minisparse.evaluation.paired import (Difference, Score, paired_differences, paired_test,
                                          score_difference)
from minisparse.plot.metrics import group_name, read_metrics
from minisparse.plot.evals import Problems, difference_text, read_per_problem

BASELINE = "dense"
MARGIN = 0.02  # non-inferiority margin: 2 points of accuracy
EVAL_KEY = re.compile(r"^eval/(.+)/accuracy$")
SEED = re.compile(r"(\d+)$")


def seed_of(run_name: str) -> str:
    """The run's trailing seed ('2' of rkv_seed2), '' for a run named without one."""
    suffix = run_name[len(group_name(run_name)):]
    match = SEED.search(suffix)
    return match.group(1) if match else ""


def checkpoint_scores(rows: list[dict]) -> dict[tuple[str, int], Score]:
    """(benchmark, rollout) -> the accuracy and 95% half-width that evaluation logged."""
    scores = {}
    for row in rows:
        for key, value in row.items():
            if match := EVAL_KEY.match(key):
                name = match.group(1)
                scores[(name, row["rollout"])] = (value, row.get(f"eval/{name}/accuracy_ci95"))
    return scores


class Run:
    """One run's scores and, read when asked, its graded samples."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.scores = checkpoint_scores(read_metrics(folder))

    def graded(self, benchmark: str, rollout: int) -> Problems | None:
        return read_per_problem(self.folder / "eval" / f"rollout_{rollout:06d}", benchmark)


def _pairs(runs: dict[str, Path]) -> dict[str, dict[str, tuple[Run, Run]]]:
    """variant -> seed -> (the baseline's run, the variant's run) of that seed."""
    by_variant: dict[str, dict[str, Run]] = {}
    for name, folder in runs.items():
        by_variant.setdefault(group_name(name), {})[seed_of(name)] = Run(folder)
    base = by_variant.get(BASELINE, {})
    return {variant: {seed: (base[seed], run) for seed, run in seeds.items() if seed in base}
            for variant, seeds in by_variant.items() if variant != BASELINE}


def _points(x: float) -> str:
    return f"{100 * x:+.1f}"


def _verdict(d: Difference, margin: float) -> list[str]:
    """p, the one-sided bound (to 0.01 point, so one near -margin reads the right way),
    whether it clears -margin."""
    if d.se is None:
        return ["-", "-", "-"]
    p = d.p_value
    return ["< 0.01" if p < 0.01 else f"{p:.2f}", f"{100 * d.lower_bound:+.2f}",
            "yes" if d.non_inferior(margin) else "no"]


def _paired_row(pairs: dict[str, tuple[Run, Run]], seeds: list[str], bench: str,
                rollout: int, margin: float) -> list[str] | None:
    """Each seed's paired difference and the pooled test; None where no seed kept samples."""
    found = {}
    for seed, (base, other) in pairs.items():
        a, b = base.graded(bench, rollout), other.graded(bench, rollout)
        if a is not None and b is not None and set(a) == set(b):
            found[seed] = paired_differences(a, b)
    if not found:
        return None
    cells = [difference_text(paired_test([found[s]])) if s in found else "-" for s in seeds]
    pooled = paired_test(list(found.values()))
    pooled_cell = f"{difference_text(pooled)} ({pooled.count:,} pairs)"
    return cells + [pooled_cell] + _verdict(pooled, margin)


def _scores_row(pairs: dict[str, tuple[Run, Run]], seeds: list[str], bench: str,
                rollout: int, margin: float) -> list[str]:
    """Each seed's gap of scores and their mean with the interval of unrelated scores."""
    scored = {s: (b.scores[(bench, rollout)], o.scores[(bench, rollout)])
              for s, (b, o) in pairs.items()}
    cells = [_points(scored[s][1][0] - scored[s][0][0]) if s in scored else "-" for s in seeds]
    pooled = score_difference(list(scored.values()))
    return cells + [difference_text(pooled)] + _verdict(pooled, margin)


def _table(title: str, pooled: str, seeds: list[str], rows: list[list[str]]) -> str:
    head = ["variant", "rollout"] + [f"seed {s}" if s else "run" for s in seeds]
    head += [pooled, "p (two-sided)", "one-sided 95% bound", "no worse by the margin"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def comparison_tables(runs: dict[str, str | Path], margin: float = MARGIN) -> str:
    """Markdown: per benchmark, the paired table (where samples were kept) and the scores
    table of every variant against the baseline; '' without a baseline and another
    variant sharing a seed with it."""
    pairs = {v: p for v, p in _pairs({n: Path(f) for n, f in runs.items()}).items() if p}
    if not pairs:
        return ""
    seeds = sorted({s for p in pairs.values() for s in p}, key=lambda s: (len(s), s))
    benches = sorted({b for p in pairs.values() for base, _ in p.values() for b, _ in base.scores})
    out = []
    for bench in benches:
        paired, scored = [], []
        for variant, p in pairs.items():
            for rollout in _common_rollouts(p, bench):
                row = _paired_row(p, seeds, bench, rollout, margin)
                if row is not None:
                    paired.append([variant, str(rollout)] + row)
                scored.append([variant, str(rollout)] + _scores_row(p, seeds, bench, rollout,
                                                                   margin))
        what = f"{bench}: each variant minus {BASELINE} of the same seed, points"
        margin_text = f"non-inferiority margin {100 * margin:g} points"
        if paired:
            out.append(_table(f"{what}, paired on the graded samples ({margin_text})",
                              "pooled over (seed, problem)", seeds, paired))
        out.append(_table(f"{what}, from the scores alone: unpaired, so wider ({margin_text})",
                          "mean of the seeds", seeds, scored))
    return "\n\n".join(out)


def _common_rollouts(pairs: dict[str, tuple[Run, Run]], bench: str) -> list[int]:
    """The rollouts at which every run of these pairs scored bench."""
    sets = [{r for b, r in run.scores if b == bench} for pair in pairs.values() for run in pair]
    return sorted(set.intersection(*sets)) if sets else []
