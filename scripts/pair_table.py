"""The dense / compressed step pair of scripts/dense_vs_sparse.sh, read from its run folders.

Each ROOT holds one pair (its `sparse/` and `dense/` runs). Printed: a Markdown table of
each run's rollout (the last one, --rollout N, or with --rollouts A-B each column's median
over those rollouts), each pair's step-time ratio dense / compressed, and over several
ROOTs (repeats of one pair) the median of every column and of the ratios: a step depends
on how long the longest sampled answer runs, so one pair of a real model is one draw, and
docs/benchmarks.md reports medians.

    python3 -m scripts.pair_table ROOT [ROOT ...] [--rollout N | --rollouts A-B]
        [--expect "sparse dense"]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from minisparse.plot.metrics import PlotError, read_metrics

RUNS = ("sparse", "dense")
COLUMNS = (  # header, metric, format
    ("step, s", "time/step_s", "{:.1f}"),
    ("rollout, s", "time/rollout_s", "{:.1f}"),
    ("rollout tokens/s", "perf/rollout_tokens_per_s", "{:,.0f}"),
    ("response tokens, mean", "rollout/response_len_mean", "{:,.0f}"),
    ("cached tokens a sequence, peak mean", "compress/peak_cache_tokens_mean", "{:,.0f}"),
    ("KV held at once, peak", "perf/peak_kv_tokens", "{:,.0f}"),
    ("compressed-token share", "compress/compressed_token_frac", "{:.2f}"),
)


def read_rollout(run: Path, rollout: int | None,
                 span: tuple[int, int] | None = None) -> dict | None:
    """The metrics row of `rollout` (default: the last) of one run, or over the rollouts
    of `span` (first, last) each metric's median, its "rollout" the span's text; None when
    a rollout asked for is not there."""
    try:
        rows = read_metrics(run)
    except PlotError:  # no metrics.jsonl: the run has not finished a rollout
        return None
    if span is not None:
        first, last = span
        rows = [row for row in rows if first <= row.get("rollout", 0) <= last]
        if len(rows) < last - first + 1:
            return None
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float))
                and all(isinstance(r.get(k), (int, float)) for r in rows)]
        return {**{k: statistics.median(r[k] for r in rows) for k in keys},
                "rollout": f"{first}-{last}"}
    if rollout is not None:
        rows = [row for row in rows if row.get("rollout") == rollout]
    return rows[-1] if rows else None


def parse_span(text: str) -> tuple[int, int]:
    """'2-4' -> (2, 4), for argparse."""
    first, sep, last = text.partition("-")
    try:
        span = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: rollouts as FIRST-LAST, e.g. 2-4")
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: FIRST-LAST with 1 <= FIRST <= LAST")
    return span


def ratios(sparse: dict, dense: dict) -> tuple[float, float]:
    """Dense / compressed: of the step time, and of the rollout phase's."""
    return (dense["time/step_s"] / sparse["time/step_s"],
            dense["time/rollout_s"] / sparse["time/rollout_s"])


def table_row(label: str, row: dict) -> str:
    cells = [fmt.format(row[key]) if key in row else "-" for _, key, fmt in COLUMNS]
    return f"| {label} | " + " | ".join(cells) + " |"


def print_pairs(pairs: list[tuple[str, dict, dict]]) -> None:
    """The table, each pair's ratio line and, over several pairs, the medians."""
    print("| pair | run | " + " | ".join(h for h, _, _ in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for label, sparse, dense in pairs:
        print(table_row(f"{label} | compressed", sparse))
        print(table_row(f"{label} | dense", dense))
    if len(pairs) > 1:
        for index, name in ((1, "compressed"), (2, "dense")):
            median = {key: statistics.median(p[index][key] for p in pairs)
                      for _, key, _ in COLUMNS if all(key in p[index] for p in pairs)}
            print(table_row(f"median of {len(pairs)} | {name}", median))
    for label, sparse, dense in pairs:
        step, rollout = ratios(sparse, dense)
        which = sparse["rollout"]
        which = f"rollouts {which} (medians)" if isinstance(which, str) else f"rollout {which}"
        print(f"{label}: {which}: step dense {dense['time/step_s']:.1f} s, "
              f"compressed {sparse['time/step_s']:.1f} s: dense / compressed {step:.2f}x "
              f"(rollout {rollout:.2f}x)")
    if len(pairs) < 2:
        return
    steps, rollouts = zip(*(ratios(s, d) for _, s, d in pairs))
    print(f"median of {len(pairs)} pairs: dense / compressed {statistics.median(steps):.2f}x a "
          f"step ({min(steps):.2f}-{max(steps):.2f}x), {statistics.median(rollouts):.2f}x a "
          f"rollout ({min(rollouts):.2f}-{max(rollouts):.2f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+", type=Path, help="a pair's folder (sparse/, dense/)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--rollout", type=int, help="this rollout of each run (default: the last)")
    which.add_argument("--rollouts", type=parse_span, metavar="A-B",
                       help="each column's median over rollouts A to B of each run")
    ap.add_argument("--expect", default=" ".join(RUNS),
                    help="the runs that must have finished (the others may come later)")
    args = ap.parse_args(argv)
    pairs = []
    for root in args.roots:
        if not any((root / name).is_dir() for name in RUNS):
            print(f"{root}: not a pair's folder (it holds no sparse/ or dense/ run)",
                  file=sys.stderr)
            return 2
        rows = {name: read_rollout(root / name, args.rollout, args.rollouts) for name in RUNS}
        failed = [name for name in args.expect.split() if rows.get(name) is None]
        if failed:
            asked = ("rollouts %d-%d" % args.rollouts if args.rollouts else
                     "rollout %d" % args.rollout if args.rollout else "a rollout")
            print(f"{root}: no step-time ratio: {' and '.join(failed)} did not finish "
                  f"{asked} (see its log)", file=sys.stderr)
            return 1
        if None in rows.values():
            later = "dense" if rows["sparse"] else "sparse"
            print(f"no step-time ratio yet: RUNS={later} with the same ROOT adds the other run")
            continue
        if rows["sparse"]["rollout"] != rows["dense"]["rollout"]:
            print(f"{root}: no step-time ratio: the runs' last rollouts differ (compressed "
                  f"{rows['sparse']['rollout']}, dense {rows['dense']['rollout']}): run both "
                  "with the same ROLLOUTS", file=sys.stderr)
            return 1
        pairs.append((root.name, rows["sparse"], rows["dense"]))
    if pairs:
        print_pairs(pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
