"""Checkpoints side by side on the paper's benchmarks, from the folders eval.py wrote:
`python -m minisparse.plot --evals RESULTS_DIR...`.

Each folder is an eval.py output (`--output`, or `--run`'s eval/full/CHECKPOINT): one
NAME/metrics.json a finished benchmark. Only metrics.json is read, so a folder kept
without its samples.jsonl (docs/runs/real/final/) prints the same table. A benchmark a
row (the paper's seven first, in its order), a folder a column; a cell is avg@n ± its 95%
interval over problems, the mean response tokens, the share cut at the length limit and,
with several samples a problem, pass@n. A benchmark a folder lacks is "not run"; one
scored with other problems, samples or length than the row's first folder says so in its
cell, so different protocols never pass for the same one. The last row averages the
benchmarks every folder finished.
"""
from __future__ import annotations

import json
from pathlib import Path

from minisparse.data.benchmarks import PAPER_BENCHMARKS
from minisparse.evaluation.scores import percent_with_interval


REQUIRED = ("accuracy", "n_samples", "problems", "mean_response_tokens", "truncated_fraction")


class EvalsError(ValueError):
    """A folder that holds no finished benchmark, or a metrics.json that is not eval.py's."""


def read_results(folder: str | Path) -> dict[str, dict]:
    """Benchmark name -> its metrics (eval.py's metrics.json 'metrics'), for one folder."""
    folder = Path(folder)
    results = {}
    for path in sorted(folder.glob("*/metrics.json")):
        try:
            metrics = json.loads(path.read_text(encoding="utf-8"))["metrics"]
            missing = [key for key in REQUIRED if key not in metrics]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise EvalsError(f"{path}: not an eval.py metrics.json ({exc})") from None
        if missing:
            raise EvalsError(f"{path}: not an eval.py metrics.json (no {', '.join(missing)})")
        results[path.parent.name] = metrics
    if not results:
        raise EvalsError(f"{folder}: no finished benchmark (no NAME/metrics.json; an eval.py "
                         f"--output folder holds one per benchmark)")
    return results


def _protocol(m: dict) -> str:
    return f"{m['problems']} x {m['n_samples']}, <= {m.get('max_new_tokens', '?')} tokens"


def _cell(m: dict, protocol: str) -> str:
    text = percent_with_interval(m, "±")
    text += (f" ({m['mean_response_tokens']:,.0f} tokens, "
             f"{100 * m['truncated_fraction']:.1f}% cut)")
    if m["n_samples"] > 1:
        k = f"pass@{m['n_samples']}"
        if k in m.get("pass_at_k", {}):
            text += f", {k} {100 * m['pass_at_k'][k]:.1f}"
    if (own := _protocol(m)) != protocol:
        text += f" [{own}]"
    return text


def evals_table(folders: dict[str, dict[str, dict]]) -> str:
    """The Markdown table of folders (column name -> read_results) side by side."""
    names = {b for results in folders.values() for b in results}
    order = [b for b in PAPER_BENCHMARKS if b in names] + sorted(names - set(PAPER_BENCHMARKS))
    lines = ["| benchmark (problems x samples, length) | " + " | ".join(folders) + " |",
             "|---" * (len(folders) + 1) + "|"]
    for bench in order:
        first = next(r[bench] for r in folders.values() if bench in r)
        protocol = _protocol(first)
        cells = [_cell(r[bench], protocol) if bench in r else "not run"
                 for r in folders.values()]
        lines.append(f"| {bench} ({protocol}) | " + " | ".join(cells) + " |")
    common = [b for b in order if all(b in r for r in folders.values())]
    if common:
        means = [sum(r[b]["accuracy"] for b in common) / len(common) for r in folders.values()]
        lines.append(f"| average of the {len(common)} every column has | "
                     + " | ".join(f"{100 * m:.1f}" for m in means) + " |")
    return "\n".join(lines)
