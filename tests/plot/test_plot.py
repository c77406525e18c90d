import json

import pytest

from minisparse.plot import curves, metrics


def write_run(folder, rows, torn_tail=""):
    folder.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (folder / "metrics.jsonl").write_text(text + torn_tail)


def test_smooth_is_a_trailing_moving_average():
    assert curves.smooth([1.0, 3.0, 5.0, 7.0], 1) == [1.0, 3.0, 5.0, 7.0]
    assert curves.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert curves.smooth([2.0, 4.0, 6.0], 10) == [2.0, 3.0, 4.0]
    with pytest.raises(curves.PlotError, match="--smooth must be >= 1"):
        curves.smooth([1.0], 0)


def test_run_in_progress_and_overlaid_runs(tmp_path, monkeypatch, capsys):
    dense = [{"rollout": i, "rollout/reward_mean": 0.1 * i, "rollout/accuracy": 0.1 * i,
              "compress/peak_cache_tokens_mean": 200.0} for i in (2, 1, 3)]
    sparse = [{"rollout": i, "rollout/reward_mean": 0.05 * i, "tis/truncated_frac": 0.2,
               "rs/rejected_token_frac": 0.1, "compress/peak_cache_tokens_mean": 96.0}
              for i in (1, 2)]
    write_run(tmp_path / "dense", dense, torn_tail='{"rollout": 4, "rollout/rew')
    write_run(tmp_path / "rkv", sparse)
    assert [r["rollout"] for r in metrics.read_rows(tmp_path / "dense" / "metrics.jsonl")] \
        == [2, 1, 3]  # as written, the torn line skipped
    rows = metrics.read_metrics(tmp_path / "dense")
    assert [r["rollout"] for r in rows] == [1, 2, 3]  # sorted
    assert curves.series(rows, "rollout/accuracy")[1] == pytest.approx([0.1, 0.2, 0.3])
    drawn = {}
    real_plot = curves.plot_runs

    def spy(runs, out, window=1, group=False):
        drawn.update(runs=list(runs), window=window)
        return real_plot(runs, out, window, group)

    monkeypatch.setattr(curves, "plot_runs", spy)
    out = tmp_path / "fig" / "curves.png"
    assert curves.main([str(tmp_path / "dense"), str(tmp_path / "rkv"), "--names", "d,s",
                      "--smooth", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert drawn == {"runs": ["d", "s"], "window": 2}
    assert "rollouts per run: d: 3, s: 2" in capsys.readouterr().out


def test_panels_hold_the_runs_that_logged_them(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {"dense": [{"rollout": 1, "rollout/reward_mean": 0.5}],
            "rkv": [{"rollout": 1, "rollout/reward_mean": 0.25, "tis/truncated_frac": 0.3,
                     "rs/rejected_token_frac": 0.1}]}
    saved = []
    real_savefig = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, *a, **k: saved.append(fig) or real_savefig(fig, *a, **k)
    try:
        curves.plot_runs(runs, tmp_path / "x.png")
    finally:
        plt.Figure.savefig = real_savefig
    axes = {ax.get_title(): ax for ax in saved[0].axes}
    reward = axes["reward"]
    assert [line.get_label() for line in reward.lines] == ["dense", "rkv"]
    assert list(reward.lines[1].get_ydata()) == [0.25]
    tis = axes["TIS truncated (-) / RS rejected (--) token fraction"]
    assert [list(line.get_ydata()) for line in tis.lines] == [[0.3], [0.1]]
    assert not tis.texts  # a panel with curves needs no note
    # a panel no run logged says why instead of standing empty
    held_out = axes["held-out accuracy (in-training eval)"]
    assert not held_out.lines
    assert [t.get_text() for t in held_out.texts] == [
        "no in-training evaluation in these runs\n(eval_interval: 0)"]
    assert [t.get_text() for t in axes["mismatch KL(sampler || dense), per token"].texts] == [
        "not logged by these runs"]


def test_errors_name_the_problem(tmp_path, capsys):
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    write_run(tmp_path / "a", [{"rollout": 1}])
    assert curves.main([str(tmp_path / "a"), "--names", "x,y", "--out",
                      str(tmp_path / "x.png")]) == 2
    assert "--names has 2 names for 1 runs" in capsys.readouterr().err


def test_figure_reads_at_a_glance(tmp_path):
    """Whole rollouts on the x axis, the runs named in one legend outside every panel,
    and a constant curve drawn on a range of at least 1, not blown up to look like noise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"rollout": i, "rollout/reward_mean": 0.0, "rollout/accuracy": 0.1 * i}
            for i in (1, 2, 3)]
    saved = []
    real_savefig = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, *a, **k: saved.append(fig) or real_savefig(fig, *a, **k)
    try:
        curves.plot_runs({"dense": rows, "rkv": rows}, tmp_path / "x.png")
    finally:
        plt.Figure.savefig = real_savefig
    fig = saved[0]
    axes = {ax.get_title(): ax for ax in fig.axes}
    ticks = axes["accuracy"].get_xticks()
    shown = [t for t in ticks if 1 <= t <= 3]
    assert shown and all(float(t).is_integer() for t in shown)
    assert all(ax.get_legend() is None for ax in fig.axes)  # no legend over a panel
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["dense", "rkv"]
    low, high = axes["reward"].get_ylim()
    assert low <= 0.0 and high >= 1.0


def test_out_defaults_to_the_first_run(tmp_path, capsys):
    write_run(tmp_path / "a", [{"rollout": 1, "rollout/accuracy": 0.5}])
    assert curves.main([str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {tmp_path / 'a' / 'curves.png'}" in capsys.readouterr().out


def _seeds(tmp_path):
    """Two variants of three and two seeds; hand-made so mean and band are known."""
    acc = {"dense_seed1": [0.1, 0.2, 0.3], "dense_seed2": [0.3, 0.4, 0.5],
           "dense_seed3": [0.2, 0.3, 0.7], "rkv-s1": [0.0, 0.1], "rkv-s2": [0.2, 0.3]}
    dirs = []
    for name, values in acc.items():
        rows = [{"rollout": i + 1, "rollout/accuracy": v} for i, v in enumerate(values)]
        for row in rows:  # held-out accuracy every 2 rollouts
            if row["rollout"] % 2 == 0:
                row["eval/average_accuracy"] = row["rollout/accuracy"] / 2
        write_run(tmp_path / name, rows)
        dirs.append(tmp_path / name)
    return dirs


def test_group_names_drop_a_trailing_seed():
    assert [metrics.group_name(n) for n in ("rkv_seed12", "rkv-seed3", "rkv_s2", "rkv-s1",
                                         "rkv_keep_prompt_seed1", "rkv2", "seeds")] == \
        ["rkv", "rkv", "rkv", "rkv", "rkv_keep_prompt", "rkv2", "seeds"]


def test_group_series_mean_and_band_over_seeds(tmp_path):
    runs = {d.name: metrics.read_metrics(d) for d in _seeds(tmp_path)}
    groups = curves.group_runs(runs)
    assert list(groups) == ["dense", "rkv"] and len(groups["dense"]) == 3
    x, mean, lo, hi = curves.group_series(groups["dense"], "rollout/accuracy")
    assert x == [1, 2, 3]
    assert mean == pytest.approx([0.2, 0.3, 0.5])
    assert lo == pytest.approx([0.1, 0.2, 0.3]) and hi == pytest.approx([0.3, 0.4, 0.7])
    # each seed smoothed on its own first: seed 3 over 2 rollouts is 0.2, 0.25, 0.5
    _, mean, lo, hi = curves.group_series(groups["dense"], "rollout/accuracy", window=2)
    assert mean == pytest.approx([0.2, 0.25, 0.4]) and hi[2] == pytest.approx(0.5)
    # only rollouts every seed logged
    rows = groups["rkv"] + [[{"rollout": 1, "rollout/accuracy": 0.9}]]
    assert curves.group_series(rows, "rollout/accuracy")[0] == [1]


def test_grouped_figure_draws_a_line_and_a_band_per_variant(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {d.name: metrics.read_metrics(d) for d in _seeds(tmp_path)}
    saved = []
    real_savefig = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, *a, **k: saved.append(fig) or real_savefig(fig, *a, **k)
    try:
        curves.plot_runs(runs, tmp_path / "x.png", group=True)
    finally:
        plt.Figure.savefig = real_savefig
    fig = saved[0]
    ax = {a.get_title(): a for a in fig.axes}["accuracy"]
    assert [list(line.get_ydata()) for line in ax.lines] == [
        pytest.approx([0.2, 0.3, 0.5]), pytest.approx([0.1, 0.2])]
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert min(band) == pytest.approx(0.1) and max(band) == pytest.approx(0.7)
    held = {a.get_title(): a for a in fig.axes}["held-out accuracy (in-training eval)"]
    assert list(held.lines[0].get_xdata()) == [2]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "dense (mean of 3 seeds, band: lowest to highest)",
        "rkv (mean of 2 seeds, band: lowest to highest)"]


def test_table_prints_mean_and_std_over_seeds(tmp_path, capsys):
    dirs = _seeds(tmp_path)
    for d in dirs:  # costs: dense peak KV 200, rkv 90 and 110; step times
        rows = metrics.read_metrics(d)
        dense = "dense" in d.name
        for row in rows:
            row["compress/peak_cache_tokens_mean"] = 200.0 if dense else (
                90.0 if d.name.endswith("1") else 110.0)
            row["time/step_s"] = 10.0 * row["rollout"]
            row["mem/rollout_peak_gib"], row["mem/update_peak_gib"] = 1.0, 3.0 + row["rollout"]
            # KV held at once: its peak over rollouts 1-2 is 2,000 (dense), 800 (rkv)
            row["perf/peak_kv_tokens"] = (1000.0 if dense else 400.0) * row["rollout"]
            if not dense:  # rejection keeps 0.6 of tokens, the veto drops 0.2 / 0.4
                row["rs/kept_token_frac"] = 0.6
                row["rs/vetoed_frac"] = 0.2 * row["rollout"]
            if "eval/average_accuracy" in row:  # one evaluation's interval: 3% / 5%
                row["eval/math500/accuracy_ci95"] = 0.03 if dense else 0.05
        write_run(d.parent / (d.name + "_"), rows)  # rewritten copies
    assert curves.main([str(d.parent / (d.name + "_")) for d in dirs]
                     + ["--names", ",".join(d.name for d in dirs), "--group", "--table"]) == 0
    out = capsys.readouterr().out
    # held-out at rollout 2 (the only one all runs evaluated): dense 10, 20, 15 %;
    # rkv 5, 15 %
    assert "| dense | 3 | 15.0 ± 5.0 |" in out and "| rkv | 2 | 10.0 ± 7.1 |" in out
    # costs over rollouts 1-2 (rkv's last): dense accuracy (0.1+0.2)/2, (0.3+0.4)/2,
    # (0.2+0.3)/2 -> 15, 35, 25 %, rkv 5, 25 %; step 15 s; KV 200 and 100 ± 14.1
    # (0.50 of dense)
    assert "over rollouts 1-2" in out
    cost = out.split("over rollouts 1-2")[1].splitlines()
    dense = next(line for line in cost if line.startswith("| dense |"))
    rkv = next(line for line in cost if line.startswith("| rkv |"))
    # columns: training accuracy, response tokens (not logged), s / rollout, tokens/s,
    # KV mean, KV max, compressed-token share, mismatch, kept tokens, vetoed sequences
    # (mean of 0.2 and 0.4), KV held at once, KV / dense, KV at once / dense (800 / 2,000),
    # GPU memory (the larger phase peak: 3 + 2)
    assert dense == ("| dense | 3 | 25.0 ± 10.0 | - | 15.0 ± 0.0 | - | 200 ± 0 | - | - | - | "
                     "- | - | 2000 ± 0 | 1.00 ± 0.00 | 1.00 ± 0.00 | 5.00 ± 0.00 |")
    assert rkv == ("| rkv | 2 | 15.0 ± 14.1 | - | 15.0 ± 0.0 | - | 100 ± 14 | - | - | - | "
                   "0.60 ± 0.00 | 0.30 ± 0.00 | 800 ± 0 | 0.50 ± 0.07 | 0.40 ± 0.00 | "
                   "5.00 ± 0.00 |")
    interval = out.split("one evaluation's 95% interval")[1].split("cost per variant")[0]
    assert "| dense | ± 3.0 |" in interval and "| rkv | ± 5.0 |" in interval
    assert not list(tmp_path.glob("*/curves.png"))  # --table alone draws nothing


def test_same_names_need_names(tmp_path, capsys):
    write_run(tmp_path / "a" / "run", [{"rollout": 1}])
    write_run(tmp_path / "b" / "run", [{"rollout": 1}])
    assert curves.main([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]) == 2
    assert "same name" in capsys.readouterr().err


def test_window_table_says_whether_compression_acts_in_every_window(tmp_path, capsys):
    """Per 10-rollout window over the rollouts every run has done (25 here: windows 1-10,
    11-20, 21-25): each run's window mean, then mean ± std over seeds."""
    for seed, base in ((1, 0.8), (2, 0.6)):
        rows = [{"rollout": r, "rollout/accuracy": 0.5,
                 "compress/compressed_token_frac": base if r <= 10 else base / 2,
                 "mismatch/kl_k1": 0.01 * (1 + (r > 20))} for r in range(1, 26)]
        write_run(tmp_path / f"rkv_seed{seed}", rows)
    write_run(tmp_path / "dense_seed1", [{"rollout": r, "rollout/accuracy": 0.25,
                                          "compress/compressed_token_frac": 0.0}
                                         for r in range(1, 31)])
    runs = [str(tmp_path / n) for n in ("dense_seed1", "rkv_seed1", "rkv_seed2")]
    assert curves.main(runs + ["--group", "--table"]) == 0
    out = capsys.readouterr().out.split("per 10-rollout window")[1]
    assert "| variant | metric | 1-10 | 11-20 | 21-25 |" in out
    assert "| rkv | compressed-token share | 0.70 ± 0.14 | 0.35 ± 0.07 | 0.35 ± 0.07 |" in out
    assert "| rkv | mismatch KL (k1) | 0.010 ± 0.000 | 0.010 ± 0.000 | 0.020 ± 0.000 |" in out
    assert "| dense | compressed-token share | 0.00 | 0.00 | 0.00 |" in out
    assert "| dense | training accuracy % | 25.0 | 25.0 | 25.0 |" in out
    assert "| dense | mismatch KL (k1) | - | - | - |" in out
