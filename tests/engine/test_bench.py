"""The bench entry point on CPU: warm-up, repeats and the JSON a user records."""
from __future__ import annotations

import json

from minisparse.engine.bench import median_run, parse_args, run


def test_median_run_picks_the_middle_tokens_per_s():
    runs = [{"tokens_per_s": t} for t in (30.0, 10.0, 20.0)]
    assert median_run(runs)["tokens_per_s"] == 20.0
    assert median_run(runs[:2])["tokens_per_s"] == 30.0


def test_bench_writes_median_of_repeats(tmp_path, tiny_path):
    path = tmp_path / "bench.json"
    args = parse_args(["--model", str(tiny_path), "--device", "cpu", "--dtype", "float32",
                       "--batch", "3", "--prompt-len", "12", "--max-new", "20",
                       "--compress", "rkv", "--budget", "16", "--divide-length", "4",
                       "--repeats", "3", "--warmup", "4", "--json", str(path)])
    result = run(args)
    saved = json.loads(path.read_text())
    assert len(saved["runs"]) == 3
    assert saved["generated_tokens"] == 3 * 20
    assert saved["tokens_per_s"] == median_run(saved["runs"])["tokens_per_s"]
    assert saved["peak_kv_tokens_per_seq"] <= 16 + 4
    assert saved["compressions"] > 0 and result["preemptions"] == 0


def test_old_flag_spellings_stay_aliases():
    new = parse_args(["--max-new-tokens", "7", "--kv-memory-fraction", "0.3"])
    old = parse_args(["--max-new", "7", "--kv-fraction", "0.3"])
    assert vars(new) == vars(old)
    assert (new.max_new_tokens, new.kv_memory_fraction) == (7, 0.3)
