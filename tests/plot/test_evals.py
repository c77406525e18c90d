import json

import pytest

from minisparse.plot import curves, evals


def write_bench(folder, name, accuracy, problems=100, n=1, max_new=8192, ci=0.05,
                tokens=512.0, cut=0.02, pass_at_k=None, samples=True):
    """One finished benchmark as eval.py leaves it (samples.jsonl optional: records drop it)."""
    bench = folder / name
    bench.mkdir(parents=True)
    metrics = {"n_samples": n, "max_new_tokens": max_new, "problems": problems,
               "samples": problems * n, "accuracy": accuracy, "accuracy_ci95": ci,
               "pass_at_k": pass_at_k or {"pass@1": accuracy},
               "mean_response_tokens": tokens, "truncated_fraction": cut}
    (bench / "metrics.json").write_text(json.dumps({"settings": {}, "metrics": metrics}))
    if samples:
        (bench / "samples.jsonl").write_text("")


def test_benchmarks_side_by_side_in_the_papers_order(tmp_path, capsys):
    dense, rkv = tmp_path / "dense", tmp_path / "rkv"
    write_bench(dense, "math500", 0.406, problems=500, ci=0.043, tokens=608.3, cut=0.006)
    write_bench(dense, "gsm8k", 0.646, problems=1319, tokens=313.0, cut=0.001)
    write_bench(dense, "aime24", 0.0104, problems=30, n=32, max_new=16384, ci=0.015,
                tokens=2020.6, cut=0.072, pass_at_k={"pass@1": 0.0104, "pass@32": 0.0667})
    write_bench(dense, "custom_set", 0.5, problems=10, samples=False)
    write_bench(rkv, "math500", 0.418, problems=500, ci=0.043, tokens=784.6, cut=0.03)
    write_bench(rkv, "gsm8k", 0.627, problems=1319, n=4, tokens=310.0, cut=0.001)
    assert curves.main([str(dense), str(rkv), "--evals"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| benchmark (problems x samples, length) | dense | rkv |"
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines[2:]}
    # the paper's seven in its order, then the others by name; no empty rows for amc23 etc.
    assert list(rows) == ["gsm8k (1319 x 1, <= 8192 tokens)", "math500 (500 x 1, <= 8192 tokens)",
                          "aime24 (30 x 32, <= 16384 tokens)", "custom_set (10 x 1, <= 8192 tokens)",
                          "average of the 2 every column has"]
    math500 = rows["math500 (500 x 1, <= 8192 tokens)"]
    assert math500 == ["40.6 ± 4.3 (608 tokens, 0.6% cut)", "41.8 ± 4.3 (785 tokens, 3.0% cut) |"]
    aime = rows["aime24 (30 x 32, <= 16384 tokens)"]
    assert aime == ["1.0 ± 1.5 (2,021 tokens, 7.2% cut), pass@32 6.7", "not run |"]
    # a column scored another way says so in its cell
    assert rows["gsm8k (1319 x 1, <= 8192 tokens)"][1].endswith("[1319 x 4, <= 8192 tokens] |")
    # averaged over the benchmarks both columns finished: gsm8k and math500
    assert rows["average of the 2 every column has"] == ["52.6", "52.2 |"]


def test_a_folder_without_results_is_named(tmp_path, capsys):
    write_bench(tmp_path / "dense", "math500", 0.4)
    (tmp_path / "empty").mkdir()
    assert curves.main([str(tmp_path / "dense"), str(tmp_path / "empty"), "--evals"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'empty'}: no finished benchmark" in err and err.count("\n") == 1


@pytest.mark.parametrize("content, said", [
    ("{not json", "not an eval.py metrics.json"),
    (json.dumps({"settings": {}}), "not an eval.py metrics.json"),
    (json.dumps({"metrics": {"accuracy": 0.5, "n_samples": 1}}),
     "no problems, mean_response_tokens, truncated_fraction"),
])
def test_a_foreign_metrics_file_is_refused_by_path(tmp_path, content, said):
    (tmp_path / "run" / "math500").mkdir(parents=True)
    (tmp_path / "run" / "math500" / "metrics.json").write_text(content)
    with pytest.raises(evals.EvalsError, match=said) as info:
        evals.read_results(tmp_path / "run")
    assert "math500/metrics.json" in str(info.value)


def write_samples(folder, name, right, questions=True):
    """samples.jsonl of one benchmark: right[i] = the graded samples of problem i."""
    rows = [{"problem_index": i, "sample_index": j, "correct": c,
             **({"question": f"q{i}"} if questions else {})}
            for i, samples in enumerate(right) for j, c in enumerate(samples)]
    (folder / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_later_columns_show_their_paired_difference_from_the_first(tmp_path, capsys):
    """Δ where a folder and the first kept samples of the same problems; none where the
    questions differ, where a side kept no samples, or in the first column itself."""
    folders = {name: tmp_path / name for name in ("dense", "rkv", "other", "bare")}
    for name, folder in folders.items():
        write_bench(folder, "math500", 0.5, problems=4, n=2, samples=name != "bare")
    write_samples(folders["dense"], "math500", [[1, 0], [1, 1], [0, 0], [0, 1]])
    write_samples(folders["rkv"], "math500", [[1, 1], [1, 1], [0, 1], [0, 1]])
    write_samples(folders["other"], "math500", [[1, 1], [1, 1], [1, 1], [1, 1]])
    rows = (folders["other"] / "math500" / "samples.jsonl").read_text().replace('"q3"', '"q9"')
    (folders["other"] / "math500" / "samples.jsonl").write_text(rows)
    assert curves.main([*map(str, folders.values()), "--evals"]) == 0
    cells = capsys.readouterr().out.splitlines()[2].split(" | ")[1:]
    # differences 0.5, 0, 0.5, 0: mean 0.25, sample variance 1/12, over 4 problems
    assert cells[1].endswith(f"; Δ +25.0 ± {100 * 1.96 * (1 / 12 / 4) ** 0.5:.1f}")
    assert "Δ" not in cells[0] and "Δ" not in cells[2] and "Δ" not in cells[3]


def test_records_kept_without_questions_pair_by_index(tmp_path):
    for name, right in (("a", [[0], [1], [0]]), ("b", [[1], [1], [0]])):
        write_bench(tmp_path / name, "gsm8k", 0.5, problems=3)
        write_samples(tmp_path / name, "gsm8k", right, questions=False)
    table = evals.compare_folders({"a": tmp_path / "a", "b": tmp_path / "b"})
    assert "; Δ +33.3 ± 65.3 |" in table.splitlines()[2]
    (tmp_path / "b" / "gsm8k" / "samples.jsonl").write_text("{broken\n")
    with pytest.raises(evals.EvalsError,
                       match="gsm8k/samples.jsonl: not an eval.py samples.jsonl"):
        evals.compare_folders({"a": tmp_path / "a", "b": tmp_path / "b"})
