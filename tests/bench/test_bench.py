"""The bench entry point on CPU: warm-up, repeats and the JSON a user records."""
from __future__ import annotations

import importlib.util
import json

import pytest

from minisparse.config.schema import CompressConfig, Config
from minisparse.bench.run import (bench_config, main, median_run, parse_args, run,
                                         run_settings, warmup_tokens)


def test_median_run_picks_the_middle_tokens_per_s():
    runs = [{"tokens_per_s": t} for t in (30.0, 10.0, 20.0)]
    assert median_run(runs)["tokens_per_s"] == 20.0
    assert median_run(runs[:2])["tokens_per_s"] == 30.0


def test_bench_writes_median_of_repeats(tmp_path, tiny_path):
    path = tmp_path / "bench.json"
    args = parse_args(["--model", str(tiny_path), "--device", "cpu", "--dtype", "float32",
                       "--batch", "3", "--prompt-len", "12", "--max-new-tokens", "20",
                       "--compress", "rkv", "--budget", "16", "--divide-length", "4",
                       "--repeats", "3", "--warmup", "4", "--json", str(path)])
    result = run(args)
    saved = json.loads(path.read_text())
    assert len(saved["runs"]) == 3
    assert saved["generated_tokens"] == 3 * 20
    assert saved["tokens_per_s"] == median_run(saved["runs"])["tokens_per_s"]
    assert saved["peak_kv_tokens_per_seq"] <= 16 + 4
    assert saved["compressions"] > 0 and result["preemptions"] == 0


def test_warmup_reaches_the_first_compression():
    base = ["--prompt-len", "160", "--budget", "512", "--divide-length", "128", "--warmup", "32"]
    assert warmup_tokens(parse_args(base)) == 32  # dense: as given
    rkv = parse_args(base + ["--compress", "rkv"])
    assert warmup_tokens(rkv) == 512 + 2 * 128 - 160 + 2  # through the second event
    assert warmup_tokens(parse_args(base + ["--compress", "rkv", "--warmup", "0"])) == 0


@pytest.mark.parametrize("prompt_len", [12, 9])
def test_warmup_runs_two_compression_events_per_sequence(tiny_path, prompt_len):
    """The first event compresses caches of whatever length first passes the budget, later
    ones caches at the cap; the warm-up must run both shapes so that no timed run compiles
    kernels (one event short of that cost ~1.1 s in every first timed run on an H200)."""
    import dataclasses

    from minisparse.bench.run import build

    args = parse_args(["--model", str(tiny_path), "--device", "cpu", "--batch", "3",
                       "--prompt-len", str(prompt_len), "--compress", "rkv", "--budget",
                       "16", "--divide-length", "4", "--warmup", "1"])
    engine, prompts, params, _ = build(args)
    engine.generate(prompts, dataclasses.replace(params, max_new_tokens=warmup_tokens(args)))
    assert engine.last_stats.compressions >= 2 * 3


def test_config_flags_come_from_the_schema():
    """Left out, every config flag keeps the schema's default; given, it overrides its key."""
    assert bench_config(parse_args([])) == Config()
    args = parse_args(["--compress", "snapkv", "--budget", "64", "--kernel-size", "3",
                       "--pooling", "avg", "--kv-memory-fraction", "0.3", "--no-overlap",
                       "--top-k", "5", "--model", "m"])
    cfg = bench_config(args)
    assert (cfg.compress.algorithm, cfg.compress.budget, cfg.compress.kernel_size) == (
        "snapkv", 64, 3)
    assert (cfg.compress.pooling, cfg.engine.kv_memory_fraction) == ("avg", 0.3)
    assert cfg.engine.overlap_decode is False and cfg.engine.cuda_graphs is True
    assert (cfg.top_k, cfg.model.path) == (5, "m")
    settings = run_settings(args, cfg)
    assert settings["compress.budget"] == 64 and settings["engine.page_size"] == 16
    assert settings["batch"] == 64 and "json" not in settings


@pytest.mark.parametrize("argv,message", [
    (["--compress", "rkv", "--budget", "8", "--window", "8"], "'compress.budget' (8) must be >"),
    (["--kernel-size", "4"], "'compress.kernel_size' must be odd and >= 1, got 4"),
    (["--kv-memory-fraction", "1.5"], "'engine.kv_memory_fraction' must be in (0, 1]"),
    (["--pooling", "mean"], "argument --pooling: invalid choice: 'mean'"),
])
def test_bad_config_flags_exit_2_naming_the_key(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_names_the_command_and_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m minisparse.bench ")
    assert "--budget BUDGET KV tokens a sequence keeps after each compression (>= 1; " \
           f"default: {CompressConfig().budget})" in out
    assert "--batch BATCH number of prompts (default: 64)" in out
    for old in ("--max-new ", "--kv-fraction", "--n "):
        assert old not in out


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang installed")
@pytest.mark.parametrize("backend", ["sglang", "both"])
def test_missing_sglang_exits_2_before_loading_a_model(backend, capsys, monkeypatch):
    import minisparse.bench.run as bench

    monkeypatch.setattr(bench, "build", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--backend", backend, "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "needs SGLang 0.5.16" in capsys.readouterr().err


def test_cuda_without_cuda_is_one_line_exit_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --device cuda: torch ")
    assert "use --device cpu" in err


def test_compression_that_never_fires_is_refused_before_the_run(capsys):
    """--budget 16 with the default --divide-length 128: a 16-token prompt is first
    compressed in a response of 130 tokens, so 64 new tokens would run dense."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--compress", "rkv", "--budget", "16", "--prompt-len", "16",
                    "--max-new-tokens", "64"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert ("a 16-token prompt is first compressed in a response of 130 tokens, longer than "
            "the 64 allowed; lower --budget or --divide-length, or raise --max-new-tokens") in err
    parse_args(["--compress", "rkv", "--budget", "16", "--prompt-len", "16",
                "--max-new-tokens", "130"])  # reaches it: runs


def test_cpu_run_prints_no_gpu_memory(tiny_path, capsys):
    args = parse_args(["--model", str(tiny_path), "--device", "cpu", "--batch", "2",
                       "--prompt-len", "8", "--max-new-tokens", "4", "--warmup", "0"])
    run(args)
    out = capsys.readouterr().out
    assert "[bench 1/1] native" in out and "GiB" not in out
