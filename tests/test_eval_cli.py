"""eval.py end to end on the tiny model (CPU): dense and RKV-compressed runs over made-up
rows of two benchmarks, skip-finished / --overwrite, settings resolution, and the exit-2
errors that must come before any model is loaded."""
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minisparse.config.schema import CompressConfig, EngineConfig
from minisparse.data.benchmarks import PAPER_BENCHMARKS
from minisparse.evaluation.generate import protocol_for

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("eval_cli", REPO / "eval.py")
eval_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_cli)

GSM8K = [
    {"question": "Ann has 2 apples and buys 3 more. How many apples?",
     "answer": "2 + 3 = <<2+3=5>>5\n#### 5", "idx": 0},
    {"question": "A box holds 4 pens. How many pens in 3 boxes?",
     "answer": "4 * 3 = <<4*3=12>>12\n#### 12", "idx": 1},
    {"question": "Tim had 1,000 dollars and spent 1. How much is left?",
     "answer": "1000 - 1 = 999\n#### 999", "idx": 2},
]
AMC23 = [
    {"id": 0, "problem": "What is 6 * 7?", "answer": 42.0, "url": "u",
     "question": "What is 6 * 7?"},
    {"id": 1, "problem": "What is 10 - 3?", "answer": 7.0, "url": "u",
     "question": "What is 10 - 3?"},
    {"id": 2, "problem": "What is 1/2 + 1/2?", "answer": 1.0, "url": "u",
     "question": "What is 1/2 + 1/2?"},
]
TINY_RUN = ["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "32",
            "--n-samples", "4", "--no-progress", "--kv-cpu-memory-gb", "0.25", "--seed", "7"]


def write_rows(data_dir, name, rows):
    path = data_dir / name / "test.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval-data")
    write_rows(d, "gsm8k", GSM8K)
    write_rows(d, "amc23", AMC23)
    return d


def run_cli(data_dir, out, *extra):
    argv = [*TINY_RUN, "--benchmarks", "gsm8k,amc23", "--data-dir", str(data_dir),
            "--output", str(out), *extra]
    return eval_cli.main(argv)


@pytest.fixture(scope="module")
def dense_out(tiny_path, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dense")
    assert run_cli(data_dir, out) == 0
    return out


@pytest.fixture(scope="module")
def rkv_out(tiny_path, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rkv")
    assert run_cli(data_dir, out, "--compress", "rkv", "--budget", "16",
                   "--divide-length", "8") == 0
    return out


def read_samples(out, name):
    return [json.loads(line) for line in (out / name / "samples.jsonl").read_text().splitlines()]


def test_dense_run_outputs(dense_out):
    summary = json.loads((dense_out / "summary.json").read_text())
    assert summary["settings"]["compress"] == {"algorithm": "none"}
    assert summary["settings"]["temperature"] == 0.8 and summary["settings"]["top_p"] == 0.95
    for name, answers in (("gsm8k", ["5", "12", "999"]), ("amc23", ["42", "7", "1"])):
        m = summary["benchmarks"][name]
        assert (m["problems"], m["samples"], m["n_samples"]) == (3, 12, 4)
        assert set(m["pass_at_k"]) == {"pass@1", "pass@2", "pass@4"}
        assert 0 < m["mean_response_tokens"] <= 32 and m["generated_tokens"] > 0
        assert m["tokens_per_s"] > 0 and m["grading_timeouts"] == 0
        rows = read_samples(dense_out, name)
        assert [(r["problem_index"], r["sample_index"]) for r in rows] == [
            (i, j) for i in range(3) for j in range(4)]
        assert [rows[4 * i]["ground_truth"] for i in range(3)] == answers
        assert all(r["finish_reason"] in ("stop", "length") and r["tokens"] <= 32 for r in rows)
        truncated = sum(r["finish_reason"] == "length" for r in rows) / 12
        assert m["truncated_fraction"] == pytest.approx(truncated)
        assert m["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / 12)
        assert all(r["num_compressions"] == 0 for r in rows)


def test_rkv_run_compresses(rkv_out):
    summary = json.loads((rkv_out / "summary.json").read_text())
    compress = summary["settings"]["compress"]
    assert (compress["algorithm"], compress["budget"], compress["divide_length"]) == ("rkv", 16, 8)
    rows = read_samples(rkv_out, "gsm8k") + read_samples(rkv_out, "amc23")
    assert len(rows) == 24
    # Prompts of ~30 tokens exceed the budget of 16: every sample gets compressed.
    assert all(r["num_compressions"] >= 1 for r in rows)
    assert summary["benchmarks"]["amc23"]["mean_compressions"] >= 1


def test_rerun_skips_finished_then_overwrite(dense_out, data_dir, capsys):
    samples = dense_out / "gsm8k" / "samples.jsonl"
    before = samples.stat().st_mtime_ns
    assert run_cli(data_dir, dense_out) == 0
    assert "[gsm8k] finished earlier" in capsys.readouterr().out
    assert samples.stat().st_mtime_ns == before
    assert run_cli(data_dir, dense_out, "--overwrite", "--benchmarks", "gsm8k") == 0
    assert samples.stat().st_mtime_ns != before


def test_other_settings_into_same_output_exit_2(dense_out, data_dir, capsys):
    assert run_cli(data_dir, dense_out, "--temperature", "0.5") == 2
    assert "differ: temperature" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["unknown", "missing", "malformed"])
def test_benchmark_errors_exit_2_naming_it(tmp_path, data_dir, case, capsys):
    benchmarks, expect = "gsm8k,amc23", ""
    data = data_dir
    if case == "unknown":
        benchmarks, expect = "gsm8k,mathx", "unknown benchmark 'mathx'"
    elif case == "missing":
        benchmarks, expect = "gsm8k,math500", f"'math500': file {data_dir}/math500/test.jsonl"
    else:
        data = tmp_path
        write_rows(tmp_path, "gsm8k", GSM8K)
        path = write_rows(tmp_path, "amc23", AMC23[:2] + [{"id": 2, "question": "q"}])
        expect = f"benchmark 'amc23': {path}:3: field 'answer'"
    code = eval_cli.main(["--model", "no/such/dir", "--benchmarks", benchmarks,
                          "--data-dir", str(data), "--output", str(tmp_path / "out")])
    assert code == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_model_dir_exit_2(tmp_path, data_dir, capsys):
    code = eval_cli.main(["--model", str(tmp_path / "nope"), "--benchmarks", "gsm8k",
                          "--data-dir", str(data_dir), "--output", str(tmp_path / "out")])
    assert code == 2
    assert f"model path '{tmp_path / 'nope'}'" in capsys.readouterr().err


def resolve(*argv):
    """(config, eval config) as eval.py resolves them (without --run: no base model)."""
    cfg, eval_cfg, base = eval_cli.resolve_settings(
        eval_cli.build_parser().parse_args(["--output", "o", *argv]))
    assert base is None
    return cfg, eval_cfg


def test_defaults_follow_the_paper_protocol():
    cfg, ev = resolve("--model", "m")
    assert ev.benchmarks == list(PAPER_BENCHMARKS)
    assert (ev.temperature, ev.top_p, ev.prompt_template) == (0.8, 0.95, "boxed")
    assert [protocol_for(b, ev) for b in ("gsm8k", "aime24", "amc23")] == [
        (1, 8192), (32, 16384), (32, 16384)]
    assert cfg.compress.algorithm == "none" and cfg.model.path == "m"
    _, ev = resolve("--model", "m", "--n-samples", "2")
    assert protocol_for("aime24", ev) == (2, 16384)


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent("""\
        model: {path: ckpt, dtype: float16}
        compress: {algorithm: rkv, budget: 64, window: 4}
        engine: {page_size: 32}
        eval: {n_samples: 8, max_new_tokens: 100}
    """))
    cfg, ev = resolve("--config", str(path), "--budget", "48", "--set", "eval.top_p=0.5")
    assert (cfg.model.path, cfg.model.dtype) == ("ckpt", "float16")
    assert (cfg.compress.algorithm, cfg.compress.budget, cfg.compress.window) == ("rkv", 48, 4)
    assert cfg.engine.page_size == 32 and ev.top_p == 0.5
    assert protocol_for("amc23", ev) == (32, 16384)  # the training config's eval is not used


def test_flags_are_the_schemas():
    """Every config flag of eval.py is built from its key; left out, the config's value
    (here the schema default) stays, and --set reaches keys without a flag."""
    parser = eval_cli.build_parser()
    dests = {a.dest for a in parser._actions}
    assert set(eval_cli.RUN_KEYS) | set(eval_cli.EVAL_KEYS) <= dests
    assert set(eval_cli.COMPRESS_KEYS) == {f"compress.{k}" for k in
                                           dataclasses.asdict(CompressConfig())}
    cfg, _ = resolve("--model", "m", "--set", "data.shuffle=false", "--set", "reward.workers=3")
    assert cfg.compress == CompressConfig() and cfg.engine == EngineConfig()
    assert cfg.data.shuffle is False and cfg.reward.workers == 3
    cfg, _ = resolve("--model", "m", "--kernel-size", "5", "--no-share-prompt-cache")
    assert cfg.compress.kernel_size == 5 and cfg.engine.share_prompt_cache is False


def test_bad_flag_values_exit_2(capsys):
    assert eval_cli.main(["--output", "o", "--model", "m", "--compress", "rkv",
                          "--budget", "4", "--window", "8"]) == 2
    assert "compress.budget" in capsys.readouterr().err
    assert eval_cli.main(["--output", "o"]) == 2
    assert "--model" in capsys.readouterr().err
    assert eval_cli.main(["--output", "o", "--model", "m", "--kernel-size", "4"]) == 2
    assert "'compress.kernel_size' must be odd and >= 1, got 4" in capsys.readouterr().err


def test_arithmetic_follows_the_difficulty_flags_and_records_it(tiny_path, tmp_path, capsys):
    """--benchmarks arithmetic scores held-out problems of the difficulty a run trained on
    (flags, or a --config's data.synthetic_*); a difficulty other than the default is part
    of the results' settings, so a rerun at another one into the same folder exits 2."""
    out = tmp_path / "easy"
    args = [*TINY_RUN, "--benchmarks", "arithmetic", "--limit", "3", "--max-new-tokens", "4",
            "--n-samples", "1", "--prompt-template", "user", "--output", str(out)]
    assert eval_cli.main([*args, "--synthetic-max-operand", "9", "--synthetic-operators",
                          "+,-", "--synthetic-operations", "2"]) == 0
    questions = [r["question"] for r in read_samples(out, "arithmetic")]
    assert len(questions) == 3
    for q in questions:
        words = q[len("What is $"):-2].split()
        assert len(words) == 5 and words[1] in "+-" and words[3] in "+-"
        assert all(1 <= int(n) <= 9 for n in words[::2])
    settings = json.loads((out / "arithmetic" / "metrics.json").read_text())["settings"]
    assert settings["arithmetic"] == {"max_operand": 9, "operators": ["+", "-"],
                                      "operations": 2}
    capsys.readouterr()
    assert eval_cli.main([*args, "--synthetic-max-operand", "20"]) == 2
    assert "differ: arithmetic" in capsys.readouterr().err
    cfg, _ = resolve("--model", "m", "--config", "smollm2_cpu")
    assert (cfg.data.synthetic_max_operand, cfg.data.synthetic_operators) == (9, ["+"])
    assert "arithmetic" not in eval_cli.run_settings(resolve("--model", "m")[0], ["arithmetic"])


def test_print_config_needs_no_output(capsys):
    assert eval_cli.main(["--model", "tiny", "--print-config"]) == 0
    assert "path: tiny" in capsys.readouterr().out
    assert eval_cli.main(["--model", "tiny"]) == 2
    assert capsys.readouterr().err == ("eval.py: error: give --output DIR (the results "
                                       "folder), or --run OUTPUT_DIR\n")


def test_run_takes_no_other_model_or_config(tmp_path, capsys):
    """--run scores the run's own checkpoint: a --model or --config beside it is refused in
    one line, before the folder is read."""
    for extra in (["--model", "m"], ["--config", "tiny_rkv"]):
        assert eval_cli.main(["--run", str(tmp_path), *extra]) == 2
        assert capsys.readouterr().err == (
            "eval.py: error: --run scores the run's own checkpoint with its recorded config; "
            "leave out --model and --config (or score a checkpoint with them, without "
            "--run)\n")


def test_a_log_shows_progress_and_ctrl_c_is_one_line(tiny_path, tmp_path):
    """Written to a file, eval.py said nothing while it generated; a Ctrl-C printed a
    KeyboardInterrupt traceback. Now a heartbeat line comes every MINISPARSE_HEARTBEAT_S
    with no other line, and Ctrl-C is one line with the command that goes on, exit 130."""
    argv = ["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--benchmarks",
            "arithmetic", "--limit", "50", "--n-samples", "16", "--max-new-tokens", "1024",
            "--kv-cpu-memory-gb", "0.25", "--output", str(tmp_path / "out")]
    env = {**os.environ, "MINISPARSE_HEARTBEAT_S": "0.5"}
    proc = subprocess.Popen([sys.executable, "eval.py", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
        if lines[-1].startswith("  [arithmetic] still running, "):
            break
    proc.send_signal(signal.SIGINT)
    rest, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert lines[0].startswith("threads: ") and "--set cpu_threads=N" in lines[0]
    assert "[arithmetic] 50 problems x 16 samples, <= 1024 new tokens\n" in lines
    assert re.fullmatch(r"  \[arithmetic\] still running, \d+ s\n", lines[-1])
    assert stderr == ("eval.py: stopped by Ctrl-C; benchmarks finished before it keep their "
                      f"results and the same command goes on with the rest: python eval.py "
                      f"{shlex.join(argv)}\n")


def test_ctrl_c_while_the_libraries_import_is_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "eval.py", "--model", "tiny", "--output",
                             str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # torch and the rest take seconds to import
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr == "eval.py: stopped by Ctrl-C while starting; nothing scored yet\n"
