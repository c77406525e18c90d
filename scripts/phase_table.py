"""Prints each rollout's phase times and GPU memory per phase from a run's metrics.jsonl.

Then the metrics asked for (--prefix, --key): the table the GPU check scripts print after
their training runs.

    python3 -m scripts.phase_table RUN/metrics.jsonl [--prefix mismatch/ ...] [--key K ...]
"""
from __future__ import annotations

import argparse
import json


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="a run's metrics.jsonl")
    ap.add_argument("--prefix", action="append", default=[],
                    help="also every metric whose name starts with this (repeatable)")
    ap.add_argument("--key", action="append", default=[], help="also this metric (repeatable)")
    args = ap.parse_args()
    with open(args.metrics) as f:
        for line in f:
            print_rollout(json.loads(line), tuple(args.prefix), args.key)


if __name__ == "__main__":
    main()
