"""The real-model figures of docs/results.md and docs/benchmarks.md are what their commands
print from the records in docs/runs/real/: an edit to a table, or to the code that prints
it, that lets the two drift apart fails here."""
import json
import re
import subprocess
import sys
from pathlib import Path

from minisparse.plot import evals
from minisparse.plot.curves import group_runs, read_metrics
from minisparse.plot.table import results_tables

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "runs" / "real"
RESULTS = (REPO / "docs" / "results.md").read_text()
BENCHMARKS = (REPO / "docs" / "benchmarks.md").read_text()


def _doc_row(text: str, label: str) -> str:
    """The first Markdown table row of text that starts with label ("| ..."), or whose
    first cell names it."""
    return next(line for line in text.splitlines() if line.startswith("| ") and (
        line.startswith(label) if label.startswith("| ") else label in line.split(" | ")[0]))


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("| \n").split(" | ")]


def test_the_ablation_table_is_the_records():
    """Every cell of the held-out table that `minisparse.plot --group --table` prints
    appears, in order, in the docs' row of that variant."""
    names = [f"{v}_seed{s}" for v in ("dense", "rkv") for s in (1, 2, 3)]
    names += [f"{v}_seed{s}" for v in ("rkv_naive", "rkv_geo") for s in (1, 2)]
    runs = {name: read_metrics(RUNS / name) for name in names}
    printed = results_tables(group_runs(runs))
    labels = {"dense": "| dense", "rkv": "(`rkv`)", "rkv_naive": "(`rkv_naive`)",
              "rkv_geo": "(`rkv_geo`)"}
    for variant, label in labels.items():
        mine = _cells(_doc_row(printed, f"| {variant} |"))
        doc = " | ".join(_cells(_doc_row(RESULTS, label))).replace("**", "")
        assert re.search(".*".join(map(re.escape, mine[1:])), doc), (variant, mine, doc)


def test_the_paired_differences_are_the_kept_samples():
    heldout = RUNS / "heldout"
    seeds = {2: ("rkv", "rkv_naive", "rkv_geo"), 3: ("rkv",)}
    for seed, variants in seeds.items():
        folders = {"dense": heldout / f"dense_seed{seed}"}
        folders |= {v: heldout / f"{v}_seed{seed}" for v in variants}
        row = _doc_row(evals.compare_folders(folders), "| math500")
        printed = re.findall(r"Δ ([+-]\d+\.\d ± \d+\.\d)", row)
        doc = _cells(_doc_row(RESULTS, f"| {seed} |"))[1:1 + len(variants)]
        assert printed == doc


def _pair_table(*names: str) -> str:
    pairs = [str(RUNS / "pair" / name) for name in names]
    return subprocess.run([sys.executable, str(REPO / "scripts" / "pair_table.py"), *pairs],
                          capture_output=True, text=True, check=True).stdout


def _same_cells(printed: str, doc: str) -> None:
    mine = _cells(printed)[2:]
    assert [c.removesuffix(" s") for c in _cells(doc)[2:]] == [
        c if c != "0.00" else "0" for c in mine]


def test_the_step_pair_medians_are_the_records():
    out = _pair_table(*(f"h200_real_{i}" for i in range(1, 6)))
    for run, label in (("compressed", "| R-KV | real, median of 5"),
                       ("dense", "| dense | real, median of 5")):
        _same_cells(_doc_row(out, f"| median of 5 | {run}"), _doc_row(BENCHMARKS, label))
    random = _pair_table("h200_random")
    for run, label in (("compressed", "| R-KV | random"), ("dense", "| dense | random")):
        _same_cells(_doc_row(random, f"| h200_random | {run}"), _doc_row(BENCHMARKS, label))
    ratio = out.splitlines()[-1]
    assert ratio.startswith("median of 5 pairs: dense / compressed 1.15x a step (0.96-1.30x), "
                            "1.22x a rollout")
    assert "1.15x a step (median of five pairs; 0.96-1.30x), 1.22x a\nrollout" in BENCHMARKS


def test_the_benchmarks_after_training_are_printed_verbatim():
    final = RUNS / "final"
    table = evals.compare_folders({"dense": final / "dense_seed2", "rkv": final / "rkv_seed2"})
    assert table in RESULTS


def test_the_base_models_figures_are_their_records():
    """Every score of docs/runs/real/base/JOB.json (eval.py's summaries) is in the table
    of the base models, as eval.py prints it."""
    from minisparse.evaluation.scores import percent_with_interval

    table = RESULTS[RESULTS.index("### Why this model"):RESULTS.index("### Commands")]
    for path in sorted((RUNS / "base").glob("*.json")):
        for name, m in json.loads(path.read_text())["benchmarks"].items():
            assert f"{percent_with_interval(m, '±')}%" in table, (path.name, name)
