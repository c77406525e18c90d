"""The evaluation loop: for each benchmark, prompts -> generate -> grade -> score, written
to its folder. eval.py runs it on a checkpoint it loads; train.py runs it on its own
rollout backend between rollouts, split over its ranks (Shard)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minisparse.config.schema import EvalConfig, RewardConfig
from minisparse.data.benchmarks import Problem
from minisparse.data.prompts import check_prompt_template, problem_prompt_ids
from minisparse.engine.backend import RolloutBackend
from minisparse.engine.config import SamplingParams
from minisparse.utils.heartbeat import heartbeat

from .generate import Shard, generate_and_grade, protocol_for
from .results import finished_results, write_benchmark_results, write_json
from .scores import sample_metrics, summarize


def evaluate(llm: RolloutBackend, tokenizer: Any, eval_cfg: EvalConfig,
             output: Path | None = None, *, problems: dict[str, list[Problem]],
             settings: dict | None = None, seed: int | None = None,
             reward: RewardConfig | None = None, overwrite: bool = False,
             progress: bool = True, log: Callable[[str], None] = print,
             shard: Shard | None = None) -> dict:
    """Every benchmark of `problems` scored with `llm`; the summary (also
    output/summary.json). `settings` (model, compression, ...) is recorded with every
    result and must match for a finished benchmark in output to be read back instead
    (overwrite: redo it). Eval settings of None take each benchmark's protocol (32
    samples and 16,384 tokens for aime24, amc23). reward: how responses are graded
    (workers, timeout_s; its function is not used: benchmarks take the math grader). With
    a Shard every rank calls this, generates its block of each benchmark and gets the
    same summary; rank 0 writes."""
    shard = shard or Shard()
    check_prompt_template(tokenizer, eval_cfg.prompt_template)
    common = json.loads(json.dumps({
        **(settings or {}), "prompt_template": eval_cfg.prompt_template,
        "temperature": eval_cfg.temperature, "top_p": eval_cfg.top_p, "seed": seed,
        "limit": eval_cfg.limit}))
    each = {name: benchmark_settings(name, common, eval_cfg) for name in problems}
    results = finished_results(output, each, overwrite)  # before any generation
    for name, items in problems.items():
        if name in results:
            log(f"[{name}] finished earlier in {output / name}, skipped (--overwrite to redo)")
            continue
        log(f"[{name}] {len(items)} problems x {each[name]['n_samples']} samples, "
            f"<= {each[name]['max_new_tokens']} new tokens")
        records, results[name] = score_benchmark(llm, tokenizer, eval_cfg, name, items,
                                                 each[name], reward, progress, shard)
        if output is not None and shard.rank == 0:
            write_benchmark_results(output / name, records,
                                    {"settings": each[name], "metrics": results[name]})
    summary = summarize(common, {name: results[name] for name in problems})
    if output is not None and shard.rank == 0:
        write_json(output / "summary.json", summary)
    return summary


def benchmark_settings(name: str, common: dict, eval_cfg: EvalConfig) -> dict:
    """What a benchmark's results depend on: the common settings with its samples and
    token limit (the protocol's where eval settings leave them unset)."""
    n, max_new = protocol_for(name, eval_cfg)
    return dict(common, n_samples=n, max_new_tokens=max_new)


def score_benchmark(llm: RolloutBackend, tokenizer: Any, eval_cfg: EvalConfig, name: str,
                    items: list[Problem], settings: dict, reward: RewardConfig | None,
                    progress: bool, shard: Shard) -> tuple[list[dict], dict]:
    """(per-sample records, metrics) of one benchmark, sampled as `settings` say."""
    n, max_new = settings["n_samples"], settings["max_new_tokens"]
    prompts = [problem_prompt_ids(tokenizer, p, eval_cfg.prompt_template) for p in items]
    params = SamplingParams.from_config(eval_cfg, n, max_new, settings["seed"])
    # a log file (no bar drawn) gets a line every half minute (utils/heartbeat.py)
    with heartbeat(name, enabled=progress and shard.rank == 0):
        records, timing = generate_and_grade(llm, tokenizer, items, prompts, params, reward,
                                             progress, shard)
    return records, {"n_samples": n, "max_new_tokens": max_new,
                     **sample_metrics(records, n), **timing}
