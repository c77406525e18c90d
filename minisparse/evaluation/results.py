"""An evaluation's result files, and resume: per benchmark NAME/samples.jsonl (one graded
sample a line) and NAME/metrics.json (its settings and scores), summary.json for the
whole. Each is written atomically, metrics.json last: it marks the benchmark finished, so
a re-run into the same folder reads it back instead of generating again, as long as it
was made with the same settings."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minisparse.utils.files import atomic_write


class ResultsMismatchError(ValueError):
    """The output directory holds finished results made with different settings."""


def write_json(path: Path, obj: Any) -> None:
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def write_benchmark_results(bench_dir: Path, records: Sequence[dict], result: dict) -> None:
    """samples.jsonl first, metrics.json last: metrics.json marks the benchmark finished."""
    with atomic_write(bench_dir / "samples.jsonl") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    write_json(bench_dir / "metrics.json", result)


def load_finished(bench_dir: Path, settings: dict) -> dict | None:
    """The saved result of a finished benchmark, None if unfinished; mismatch raises."""
    metrics_path = bench_dir / "metrics.json"
    if not (metrics_path.is_file() and (bench_dir / "samples.jsonl").is_file()):
        return None
    saved = json.loads(metrics_path.read_text(encoding="utf-8"))
    if saved.get("settings") != settings:
        differ = sorted(k for k in set(settings) | set(saved.get("settings", {}))
                        if settings.get(k) != saved.get("settings", {}).get(k))
        raise ResultsMismatchError(
            f"{metrics_path} holds results made with other settings (differ: "
            f"{', '.join(differ)}); pass --overwrite or choose another output directory"
        )
    return saved


def finished_results(output: Path | None, settings: dict[str, dict],
                     overwrite: bool) -> dict[str, dict]:
    """Benchmark -> metrics saved in output by an earlier run with the same settings (none
    with overwrite or without a folder). Read before any generation, so results made with
    other settings stop the run before it spends anything (ResultsMismatchError)."""
    if output is None or overwrite:
        return {}
    saved = {name: load_finished(output / name, s) for name, s in settings.items()}
    return {name: result["metrics"] for name, result in saved.items() if result is not None}
