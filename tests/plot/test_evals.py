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
