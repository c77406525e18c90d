"""scripts/keep_records.py: a run's records, its graded samples cut to what pairing needs,
nothing of the benchmark's rows, checkpoints or logs."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "scripts.keep_records", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def _fake_run(root):
    run = root / "rkv_seed1"
    bench = run / "eval" / "rollout_000010" / "math500"
    bench.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"rollout": 1}\n')
    (bench / "metrics.json").write_text('{"metrics": {"accuracy": 0.5}}')
    (bench / "samples.jsonl").write_text("".join(json.dumps(
        {"problem_index": i // 2, "sample_index": i % 2, "question": "What is 1+1?",
         "response": "\\boxed{2}", "correct": i % 3 == 0, "tokens": 9}) + "\n"
        for i in range(4)))
    (run / "checkpoints" / "rollout_000010").mkdir(parents=True)
    (run / "checkpoints" / "rollout_000010" / "metrics.json").write_text("{}")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "summary.json").write_text("{}")
    (run.parent / "rkv_seed1.log").write_text("log")
    (run / "train.log").write_text("log")
    return run


def test_records_keep_metrics_and_cut_samples(tmp_path):
    run = _fake_run(tmp_path / "runs")
    res = _run(run, "--out", tmp_path / "kept")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("3 files, 4 graded samples cut to problem_index, "
                                       "sample_index, correct")
    kept = tmp_path / "kept" / "rkv_seed1"
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file()) == [
        "eval/rollout_000010/math500/metrics.json", "eval/rollout_000010/math500/samples.jsonl",
        "metrics.jsonl"]
    samples = (kept / "eval" / "rollout_000010" / "math500" / "samples.jsonl").read_text()
    assert [json.loads(line) for line in samples.splitlines()] == [
        {"problem_index": 0, "sample_index": 0, "correct": True},
        {"problem_index": 0, "sample_index": 1, "correct": False},
        {"problem_index": 1, "sample_index": 0, "correct": False},
        {"problem_index": 1, "sample_index": 1, "correct": True}]
    assert "What is" not in samples and (kept / "metrics.jsonl").read_text() == '{"rollout": 1}\n'


def test_bad_sources_exit_2_naming_them(tmp_path):
    res = _run(tmp_path / "missing", "--out", tmp_path / "kept")
    assert res.returncode == 2
    assert res.stderr == f"keep_records: {tmp_path / 'missing'}: not a folder\n"
    run = _fake_run(tmp_path)
    samples = run / "eval" / "rollout_000010" / "math500" / "samples.jsonl"
    samples.write_text('{"problem_index": 0, "sample_index": 0, "correct": true}\n'
                       '{"problem_index": 1}\n')
    res = _run(run, "--out", tmp_path / "kept")
    assert res.returncode == 2 and f"{samples}:2: not a graded sample" in res.stderr
