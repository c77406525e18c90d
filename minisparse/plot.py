"""Training curves of one or more runs, overlaid, from their metrics.jsonl.

    python -m minisparse.plot outputs/smollm2_dense outputs/smollm2_rkv --out curves.png
    python -m minisparse.plot outputs/a outputs/b --names dense,rkv --smooth 5 --out ab.png

Reads only metrics.jsonl (one row per rollout), so it works on a run still in progress:
a line cut short by a write in flight is skipped. Runs are named by their folder unless
--names is given; a panel leaves out the runs that never logged its metric (a dense run
has no TIS truncation).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (title, [(metric, line style)]): the curves the ablation is read from
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", (("rollout/reward_mean", "-"),)),
    ("accuracy", (("rollout/accuracy", "-"),)),
    ("response length (tokens)", (("rollout/response_len_mean", "-"),)),
    ("peak KV per sequence (tokens)", (("compress/peak_cache_tokens_mean", "-"),)),
    ("mismatch KL(sampler || dense), per token", (("mismatch/kl_k1", "-"),)),
    ("TIS truncated (-) / RS rejected (--) token fraction",
     (("tis/truncated_frac", "-"), ("rs/rejected_token_frac", "--"))),
)


class PlotError(ValueError):
    """A run folder without metrics, or bad arguments; names which."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl in rollout order; torn or non-row lines skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (not a run's output_dir, or not "
                        f"started yet)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written right now
        if isinstance(row, dict) and isinstance(row.get("rollout"), int):
            rows.append(row)
    return sorted(rows, key=lambda r: r["rollout"])


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


def plot_runs(runs: dict[str, list[dict]], out: str | Path, window: int = 1) -> Path:
    """One figure, a panel per PANELS entry, every run a colour; written to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, curves) in zip(axes.flat, PANELS):
        for i, (name, rows) in enumerate(runs.items()):
            for key, style in curves:
                x, y = series(rows, key)
                if x:
                    ax.plot(x, smooth(y, window), style, color=colours[i % len(colours)],
                            label=name if style == "-" else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if window > 1:
        fig.suptitle(f"moving average over {window} rollouts", fontsize=9)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's output_dir")
    parser.add_argument("--out", required=True, help="image file (.png, .pdf, .svg)")
    parser.add_argument("--names", default=None, help="comma-separated, one per RUN_DIR")
    parser.add_argument("--smooth", type=int, default=1,
                        help="moving average over this many rollouts (default 1: raw)")
    args = parser.parse_args(argv)
    try:
        names = args.names.split(",") if args.names else [Path(r).name for r in args.runs]
        if len(names) != len(args.runs):
            raise PlotError(f"--names has {len(names)} names for {len(args.runs)} runs")
        runs = {name: read_metrics(run) for name, run in zip(names, args.runs)}
        path = plot_runs(runs, args.out, args.smooth)
    except PlotError as exc:
        print(f"plot error: {exc}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{n}: {len(r)}" for n, r in runs.items())
    print(f"wrote {path} (rollouts per run: {counts})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
