"""Prints each rollout's phase times and GPU memory per phase from a run's metrics.jsonl.

Then the metrics asked for (--prefix, --key): the table the GPU check scripts print after
their training runs.

    python3 -m scripts.phase_table RUN[/metrics.jsonl] [--prefix mismatch/ ...] [--key K ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minisparse.plot.metrics import PlotError, read_metrics


def print_rollout(row: dict, prefixes: tuple[str, ...], keys: list[str]) -> None:
    print(f"--- rollout {row['rollout']}: phase times (s), GPU memory (GiB)")
    print(f"{'phase':16s} {'time_s':>8s} {'peak_gib':>8s} {'end_gib':>8s} {'reserved':>9s}")
    for p in [k[5:-2] for k in row if k.startswith("time/")]:
        g = lambda k: row.get(f"mem/{p}_{k}", float("nan"))  # noqa: E731
        print(f"{p:16s} {row['time/' + p + '_s']:8.2f} {g('peak_gib'):8.2f} "
              f"{g('end_gib'):8.2f} {g('reserved_gib'):9.2f}")
    shown = sorted(k for k in row if prefixes and k.startswith(prefixes)) + keys
    for k in shown:
        print(f"{k:34s} {row.get(k, float('nan')):.6g}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run's output_dir, or its metrics.jsonl")
    ap.add_argument("--prefix", action="append", default=[],
                    help="also every metric whose name starts with this (repeatable)")
    ap.add_argument("--key", action="append", default=[], help="also this metric (repeatable)")
    args = ap.parse_args(argv)
    run = Path(args.run)
    try:
        rows = read_metrics(run.parent if run.name == "metrics.jsonl" else run)
    except PlotError as exc:
        print(f"phase_table: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        print_rollout(row, tuple(args.prefix), args.key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
