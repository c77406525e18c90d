"""Checkpoints side by side on the paper's benchmarks, from the folders eval.py wrote:
`python -m minisparse.plot --evals RESULTS_DIR...`.

Each folder is an eval.py output (`--output`, or `--run`'s eval/full/CHECKPOINT, or a
run's in-training eval/rollout_N): one NAME/metrics.json a finished benchmark. A benchmark
a row (the paper's seven first, in its order), a folder a column; a cell is avg@n ± its
95% interval over problems, the mean response tokens, the share cut at the length limit
and, with several samples a problem, pass@n. A benchmark a folder lacks is "not run"; one
scored with other problems, samples or length than the row's first folder says so in its
cell, so different protocols never pass for the same one. The last row averages the
benchmarks every folder finished.

Where a folder and the first one both kept NAME/samples.jsonl for the same problems, its
cell adds "Δ": its accuracy minus the first folder's with the 95% interval of that
difference taken problem by problem. Checkpoints scored on the same problems share each
problem's difficulty, so this interval is the one to read when asking whether a run beat
another: it is narrower than the two scores' intervals side by side. Folders kept
without samples (docs/runs/real/final/) print the table without it.
"""
from __future__ import annotations

import json
from pathlib import Path

from minisparse.data.benchmarks import PAPER_BENCHMARKS
from minisparse.evaluation.paired import Difference, paired_differences, paired_test
from minisparse.evaluation.scores import per_problem_accuracy, percent_with_interval


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


Problems = dict[tuple[int, str | None], float]  # (problem_index, its question) -> accuracy


def read_per_problem(folder: str | Path, benchmark: str) -> Problems | None:
    """Each problem's accuracy from the folder's BENCHMARK/samples.jsonl, None without one.
    Keyed by index and question text (where the records keep it), so two folders pair up
    only when they scored the same problems; records kept without the text (the
    benchmark's rows stay out of this repository) pair by index."""
    path = Path(folder) / benchmark / "samples.jsonl"
    if not path.exists():
        return None
    try:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                   if line.strip()]
        questions = {r["problem_index"]: r.get("question") for r in records}
        return {(index, questions[index]): accuracy
                for index, accuracy in per_problem_accuracy(records).items()} or None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise EvalsError(f"{path}: not an eval.py samples.jsonl ({exc})") from None


def difference_text(diff: Difference) -> str:
    """'+1.3 ± 2.9': a difference in points with its 95% interval, where it has one."""
    return f"{100 * diff.mean:+.1f}" + ("" if diff.ci95 is None else f" ± {100 * diff.ci95:.1f}")


def _difference(base: Problems | None, other: Problems | None) -> str:
    """'; Δ +1.3 ± 2.9' against the first column, where both scored the same problems."""
    if base is None or other is None or set(base) != set(other):
        return ""
    return "; Δ " + difference_text(paired_test([paired_differences(base, other)]))


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


def evals_table(folders: dict[str, dict[str, dict]],
                per_problem: dict[str, dict[str, Problems | None]] | None = None) -> str:
    """The Markdown table of folders (column name -> read_results) side by side; with
    per_problem (column name -> benchmark -> read_per_problem), each later column's
    difference from the first."""
    per_problem = per_problem or {}
    names = {b for results in folders.values() for b in results}
    order = [b for b in PAPER_BENCHMARKS if b in names] + sorted(names - set(PAPER_BENCHMARKS))
    lines = ["| benchmark (problems x samples, length) | " + " | ".join(folders) + " |",
             "|---" * (len(folders) + 1) + "|"]
    for bench in order:
        first = next(r[bench] for r in folders.values() if bench in r)
        protocol = _protocol(first)
        base = per_problem.get(next(iter(folders)), {}).get(bench)
        cells = []
        for column, (name, results) in enumerate(folders.items()):
            if bench not in results:
                cells.append("not run")
                continue
            later = _difference(base, per_problem.get(name, {}).get(bench)) if column else ""
            cells.append(_cell(results[bench], protocol) + later)
        lines.append(f"| {bench} ({protocol}) | " + " | ".join(cells) + " |")
    common = [b for b in order if all(b in r for r in folders.values())]
    if common:
        means = [sum(r[b]["accuracy"] for b in common) / len(common) for r in folders.values()]
        lines.append(f"| average of the {len(common)} every column has | "
                     + " | ".join(f"{100 * m:.1f}" for m in means) + " |")
    return "\n".join(lines)


def compare_folders(folders: dict[str, str | Path]) -> str:
    """The table of eval.py folders (column name -> folder), differences included."""
    results = {name: read_results(folder) for name, folder in folders.items()}
    if len(folders) < 2:  # no difference to take: leave the samples unread
        return evals_table(results)
    per_problem = {name: {bench: read_per_problem(folders[name], bench) for bench in found}
                   for name, found in results.items()}
    return evals_table(results, per_problem)
