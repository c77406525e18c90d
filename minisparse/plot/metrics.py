"""A run's metrics.jsonl read back: the one reader of the curves, the results tables and
the scripts that check or tabulate runs (scripts/phase_table.py, soak_resume.py,
pair_table.py); and the variant a run belongs to, by its name."""
from __future__ import annotations

import json
import re
from pathlib import Path

# A trailing seed in a run's name: rkv_seed2, rkv-seed2, rkv_s2, rkv-s2.
SEED_SUFFIX = re.compile(r"[_-](?:seed|s)\d+$")


class PlotError(ValueError):
    """A run folder without metrics, or bad arguments; names which."""


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl in the order they were written (nothing if there is no
    file yet). A line cut short by a write in flight, or one that is no rollout's row, is
    skipped: a run still going, or one killed mid-write, reads as its complete rows."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("rollout"), int):
            rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl in rollout order; PlotError when there is none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (not a run's output_dir, or not "
                        f"started yet)")
    return sorted(read_rows(path), key=lambda r: r["rollout"])


def group_name(run_name: str) -> str:
    """The variant a run belongs to: its name without a trailing seed."""
    return SEED_SUFFIX.sub("", run_name)
