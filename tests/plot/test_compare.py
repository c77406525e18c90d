"""minisparse/plot/compare.py: each variant against dense of the same seed, paired where
the runs kept graded samples, from the scores at every checkpoint; hand-computed values."""
import json

from minisparse.plot import compare, curves

# (rollout, accuracy, its 95% half-width): se 0.02 and 0.01 make the sums easy
SCORES = {"dense_seed1": [(0, 0.5, 0.0392), (10, 0.5, 0.0392)],
          "rkv_seed1": [(0, 0.5, 0.0392), (10, 0.75, 0.0392)],
          "dense_seed2": [(0, 0.4, 0.0196), (10, 0.4, 0.0196)],
          "rkv_seed2": [(0, 0.4, 0.0196), (10, 0.45, 0.0196)]}
# seed 1 kept its rollout-10 samples, 4 problems x 1 sample; seed 2 kept none
GRADED = {"dense_seed1": [1, 0, 0, 1], "rkv_seed1": [1, 1, 0, 1]}


def write_runs(root):
    for name, scores in SCORES.items():
        run = root / name
        run.mkdir()
        rows = [{"rollout": r, "eval/math500/accuracy": a, "eval/math500/accuracy_ci95": w}
                for r, a, w in scores]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if name in GRADED:  # as scripts/keep_records.py cuts them
            bench = run / "eval" / "rollout_000010" / "math500"
            bench.mkdir(parents=True)
            (bench / "samples.jsonl").write_text("".join(
                json.dumps({"problem_index": i, "sample_index": 0, "correct": bool(c)}) + "\n"
                for i, c in enumerate(GRADED[name])))
    return {name: root / name for name in SCORES}


def _rows(text, title):
    """The table rows after the line that starts with title."""
    block = text[text.index(title):].split("\n\n")[1]
    return block.splitlines()[2:]


def test_paired_where_samples_were_kept_and_scores_at_every_checkpoint(tmp_path, capsys):
    runs = write_runs(tmp_path)
    assert curves.main([*map(str, runs.values()), "--group", "--table"]) == 0
    out = capsys.readouterr().out
    paired = _rows(out, "math500: each variant minus dense of the same seed, points, paired")
    # seed 1's differences 0, 1, 0, 0: mean 0.25, sample variance 0.25, se 0.25; z = 1:
    # p 0.32, bound 0.25 - 1.645 * 0.25 = -0.161; seed 2 kept none
    assert paired == ["| rkv | 10 | +25.0 ± 49.0 | - | +25.0 ± 49.0 (4 pairs) | 0.32 | -16.12 "
                      "| no |"]
    scored = _rows(out, "math500: each variant minus dense of the same seed, points, from")
    # gaps 0.25 and 0.05: mean 0.15, se sqrt(2 * 0.02^2 + 2 * 0.01^2) / 2 = 0.0158;
    # bound 0.15 - 1.645 * 0.0158 = 0.124; before training the same scores: gap 0
    assert scored == ["| rkv | 0 | +0.0 | +0.0 | +0.0 ± 3.1 | 1.00 | -2.60 | no |",
                      "| rkv | 10 | +25.0 | +5.0 | +15.0 ± 3.1 | < 0.01 | +12.40 | yes |"]
    assert "non-inferiority margin 2 points" in out


def test_the_margin_is_a_setting(tmp_path, capsys):
    runs = write_runs(tmp_path)
    assert curves.main([*map(str, runs.values()), "--group", "--table", "--margin", "20"]) == 0
    out = capsys.readouterr().out
    assert "non-inferiority margin 20 points" in out
    assert _rows(out, "math500: each variant minus dense of the same seed, points, paired")[0] \
        .endswith("| -16.12 | yes |")


def test_no_dense_or_no_shared_seed_prints_no_comparison(tmp_path):
    runs = write_runs(tmp_path)
    assert compare.comparison_tables({k: v for k, v in runs.items() if "rkv" in k}) == ""
    assert compare.comparison_tables({"dense_seed1": runs["dense_seed1"],
                                      "rkv_seed2": runs["rkv_seed2"]}) == ""


def test_seed_of_reads_the_trailing_seed():
    assert [compare.seed_of(n) for n in ("rkv_seed2", "rkv_naive-s13", "dense")] == ["2", "13", ""]
