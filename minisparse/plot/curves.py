"""Training curves of one or more runs, overlaid, from their metrics.jsonl.

    python -m minisparse.plot outputs/smollm2_cpu                  # outputs/smollm2_cpu/curves.png
    python -m minisparse.plot outputs/smollm2_dense outputs/smollm2_rkv --out curves.png
    python -m minisparse.plot outputs/a outputs/b --names dense,rkv --smooth 5 --out ab.png
    python -m minisparse.plot outputs/ablation/*_seed* --group --out ablation.png
    python -m minisparse.plot outputs/ablation/*_seed* --group --table   # results tables
    python -m minisparse.plot --evals results/dense results/rkv          # eval.py's results

Reads only metrics.jsonl (one row per rollout), so it works on a run still in progress:
a line cut short by a write in flight is skipped. Runs are named by their folder unless
--names is given, in one legend above the panels; a panel leaves out the runs that never
logged its metric (a dense run has no TIS truncation). Without --out the figure goes to
curves.png in the first run's folder.

--group draws the runs of one variant as one line: runs whose names differ only in a
trailing seed (rkv_seed1, rkv_seed2; rkv-s1, rkv_s2) are a group, drawn as the mean over
its seeds at the rollouts every one of them logged, with a band from the lowest to the
highest seed. --table prints the held-out accuracy and cost tables (minisparse/plot/table.py)
of the groups instead of drawing (and draws too when --out is given); with --group and a
variant named dense, then each variant against dense of the same seed, paired on the
graded samples the runs kept (minisparse/plot/compare.py). --evals reads
eval.py's results folders instead of runs and prints their benchmarks side by side
(minisparse/plot/evals.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minisparse.plot.evals import EvalsError, compare_folders
from minisparse.plot.metrics import PlotError, group_name, read_metrics

# (title, [(metric, line style)]): the curves the ablation is read from
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", (("rollout/reward_mean", "-"),)),
    ("accuracy", (("rollout/accuracy", "-"),)),
    ("response length (tokens)", (("rollout/response_len_mean", "-"),)),
    ("peak KV per sequence (tokens)", (("compress/peak_cache_tokens_mean", "-"),)),
    ("tokens sampled from a compressed cache (share)",
     (("compress/compressed_token_frac", "-"),)),
    ("mismatch KL(sampler || dense), per token", (("mismatch/kl_k1", "-"),)),
    ("TIS truncated (-) / RS rejected (--) token fraction",
     (("tis/truncated_frac", "-"), ("rs/rejected_token_frac", "--"))),
    ("held-out accuracy (in-training eval)", (("eval/average_accuracy", "-"),)),
)
# Logged only every eval_interval rollouts: drawn point to point, never smoothed.
SPARSE = ("eval/",)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (1: unchanged); the first points
    average over what exists so far, so the curve starts at the first rollout."""
    if window < 1:
        raise PlotError(f"--smooth must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(rollouts, values) of the rows that logged `key`."""
    points = [(r["rollout"], float(r[key])) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def group_runs(runs: dict[str, list[dict]]) -> dict[str, list[list[dict]]]:
    """Runs by group_name, in the order each group first appears."""
    groups: dict[str, list[list[dict]]] = {}
    for name, rows in runs.items():
        groups.setdefault(group_name(name), []).append(rows)
    return groups


def group_series(seeds: list[list[dict]], key: str, window: int = 1
                 ) -> tuple[list[int], list[float], list[float], list[float]]:
    """(rollouts, mean, lowest, highest) over the seeds' runs at the rollouts every one of
    them logged `key`, each run smoothed over `window` of its own points first."""
    curves = []
    for rows in seeds:
        x, y = series(rows, key)
        curves.append(dict(zip(x, smooth(y, window))))
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = [[c[r] for c in curves] for r in common]
    return (common, [sum(v) / len(v) for v in values], [min(v) for v in values],
            [max(v) for v in values])


def plot_runs(runs: dict[str, list[dict]], out: str | Path, window: int = 1,
              group: bool = False) -> Path:
    """One figure, a panel per PANELS entry, every run (or with group, every group of
    seeds: mean line, min..max band) a colour; written to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    cols = -(-len(PANELS) // 2)
    fig, axes = plt.subplots(2, cols, figsize=(5 * cols, 8), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lines = group_runs(runs) if group else {name: [rows] for name, rows in runs.items()}
    handles = {}
    for ax, (title, curves) in zip(axes.flat, PANELS):
        for i, (name, seeds) in enumerate(lines.items()):
            label = name
            if group:
                label += (f" (mean of {len(seeds)} seeds, band: lowest to highest)"
                          if len(seeds) > 1 else " (1 seed)")
            for key, style in curves:
                sparse = key.startswith(SPARSE)
                x, mean, lo, hi = group_series(seeds, key, 1 if sparse else window)
                if not x:
                    continue
                colour = colours[i % len(colours)]
                line, = ax.plot(x, mean, style, color=colour,
                                marker="." if len(x) < 30 or sparse else None,
                                label=label if style == "-" else None)
                if group and len(seeds) > 1:
                    ax.fill_between(x, lo, hi, color=colour, alpha=0.2, linewidth=0)
                handles.setdefault(label, line)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        _flat_range(ax)
        if not ax.lines:  # an empty panel says why rather than look like a failed plot
            ax.text(0.5, 0.5, _not_logged(curves), ha="center", va="center",
                    transform=ax.transAxes, fontsize=9, color="0.4", wrap=True)
    for ax in axes.flat[len(PANELS):]:
        ax.set_visible(False)
    # One legend for the figure, outside every panel, so it covers no line.
    fig.legend([h for h in handles.values()], list(handles), loc="outside upper center",
               ncols=min(len(handles), 6), fontsize=9, frameon=False)
    if window > 1:
        fig.supxlabel(f"moving average over {window} rollouts (held-out accuracy: raw)",
                      fontsize=9)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _not_logged(curves: tuple[tuple[str, str], ...]) -> str:
    """The note of a panel no run logged a metric of."""
    if any(key.startswith("eval/") for key, _ in curves):
        return "no in-training evaluation in these runs\n(eval_interval: 0)"
    return "not logged by these runs"


def _flat_range(ax) -> None:
    """A panel whose curves are all one value gets a y range around it of at least 1 (all
    zero: about 0 to 1) instead of matplotlib's +-0.05, which makes a constant look like noise."""
    ys = [y for line in ax.lines for y in line.get_ydata()]
    if ys and max(ys) == min(ys):
        v = ys[0]
        ax.set_ylim((-0.05, v + 1) if v >= 0 else (v - 1, 0.05))


def build_parser() -> argparse.ArgumentParser:
    from minisparse.config.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="python -m minisparse.plot",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="a run's output_dir (with --evals: an eval.py results folder)")
    parser.add_argument("--out", default=None,
                        help="image file (.png, .pdf, .svg); default: curves.png in the "
                             "first RUN_DIR")
    parser.add_argument("--names", default=None, help="comma-separated, one per RUN_DIR")
    parser.add_argument("--smooth", type=int, default=1,
                        help="moving average over this many rollouts (1: raw)")
    parser.add_argument("--group", action="store_true",
                        help="one line per variant: runs named alike but for a trailing "
                             "seed (_seed1, -s2) drawn as their mean with a min..max band")
    parser.add_argument("--table", action="store_true",
                        help="print the held-out accuracy and cost tables per variant (mean "
                             "± std over seeds) instead of drawing; --out draws as well")
    parser.add_argument("--margin", type=float, default=2.0,
                        help="with --group --table: the non-inferiority margin, in points "
                             "of accuracy, each variant's one-sided 95%% bound against dense "
                             "must clear")
    parser.add_argument("--evals", action="store_true",
                        help="the folders are eval.py results (NAME/metrics.json a "
                             "benchmark): print their benchmarks side by side, a folder a "
                             "column, each later one's paired difference from the first "
                             "where both kept samples.jsonl")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names = args.names.split(",") if args.names else [Path(r).name for r in args.runs]
        if len(names) != len(args.runs):
            raise PlotError(f"--names has {len(names)} names for {len(args.runs)} runs")
        if len(set(names)) != len(names):
            raise PlotError("two runs have the same name; give --names")
        if args.evals:
            print(compare_folders(dict(zip(names, args.runs))))
            return 0
        runs = {name: read_metrics(run) for name, run in zip(names, args.runs)}
        if args.table:
            from minisparse.plot.compare import comparison_tables
            from minisparse.plot.table import results_tables

            print(results_tables(group_runs(runs) if args.group
                                 else {n: [r] for n, r in runs.items()}))
            if args.group and (against := comparison_tables(dict(zip(names, args.runs)),
                                                            args.margin / 100)):
                print(against)
        path = None
        if args.out or not args.table:
            path = plot_runs(runs, args.out or Path(args.runs[0]) / "curves.png", args.smooth,
                             args.group)
    except (PlotError, EvalsError) as exc:
        print(f"plot error: {exc}", file=sys.stderr)
        return 2
    if path is not None:
        counts = ", ".join(f"{n}: {len(r)}" for n, r in runs.items())
        print(f"wrote {path} (rollouts per run: {counts})")
    return 0

