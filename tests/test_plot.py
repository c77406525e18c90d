import json

import pytest

from minisparse import plot


def write_run(folder, rows, torn_tail=""):
    folder.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (folder / "metrics.jsonl").write_text(text + torn_tail)


def test_smooth_is_a_trailing_moving_average():
    assert plot.smooth([1.0, 3.0, 5.0, 7.0], 1) == [1.0, 3.0, 5.0, 7.0]
    assert plot.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot.smooth([2.0, 4.0, 6.0], 10) == [2.0, 3.0, 4.0]
    with pytest.raises(plot.PlotError, match="--smooth must be >= 1"):
        plot.smooth([1.0], 0)


def test_run_in_progress_and_overlaid_runs(tmp_path, monkeypatch, capsys):
    dense = [{"rollout": i, "rollout/reward_mean": 0.1 * i, "rollout/accuracy": 0.1 * i,
              "compress/peak_cache_tokens_mean": 200.0} for i in (2, 1, 3)]
    sparse = [{"rollout": i, "rollout/reward_mean": 0.05 * i, "tis/truncated_frac": 0.2,
               "rs/rejected_token_frac": 0.1, "compress/peak_cache_tokens_mean": 96.0}
              for i in (1, 2)]
    write_run(tmp_path / "dense", dense, torn_tail='{"rollout": 4, "rollout/rew')
    write_run(tmp_path / "rkv", sparse)
    rows = plot.read_metrics(tmp_path / "dense")
    assert [r["rollout"] for r in rows] == [1, 2, 3]  # sorted, torn line skipped
    assert plot.series(rows, "rollout/accuracy")[1] == pytest.approx([0.1, 0.2, 0.3])
    drawn = {}
    real_plot = plot.plot_runs

    def spy(runs, out, window=1):
        drawn.update(runs=list(runs), window=window)
        return real_plot(runs, out, window)

    monkeypatch.setattr(plot, "plot_runs", spy)
    out = tmp_path / "fig" / "curves.png"
    assert plot.main([str(tmp_path / "dense"), str(tmp_path / "rkv"), "--names", "d,s",
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
        plot.plot_runs(runs, tmp_path / "x.png")
    finally:
        plt.Figure.savefig = real_savefig
    axes = {ax.get_title(): ax for ax in saved[0].axes}
    reward = axes["reward"]
    assert [line.get_label() for line in reward.lines] == ["dense", "rkv"]
    assert list(reward.lines[1].get_ydata()) == [0.25]
    tis = axes["TIS truncated (-) / RS rejected (--) token fraction"]
    assert [list(line.get_ydata()) for line in tis.lines] == [[0.3], [0.1]]


def test_errors_name_the_problem(tmp_path, capsys):
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    write_run(tmp_path / "a", [{"rollout": 1}])
    assert plot.main([str(tmp_path / "a"), "--names", "x,y", "--out",
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
        plot.plot_runs({"dense": rows, "rkv": rows}, tmp_path / "x.png")
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
    assert plot.main([str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {tmp_path / 'a' / 'curves.png'}" in capsys.readouterr().out
