"""Benchmark evaluation through the rollout engine: prompts, generation, grading, metrics
and result files. eval.py drives it from the command line; train.py calls `evaluate` every
eval_interval steps with its own engine, so nothing here loads models or parses flags.

Protocol (Sparse-RL paper / Qwen2.5-Math harness): every sample is graded with
minisparse.data.reward (math-verify); a benchmark reports avg@n (mean accuracy over all samples)
and unbiased pass@k for the powers of two up to n. Results are written per benchmark and
atomically, so a re-run into the same directory can skip what is already finished.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any

from minisparse.data.benchmarks import (REGISTRY, TRAINING_FILE, Problem, get_spec,
                                        load_benchmarks)
from minisparse.config.schema import (ConfigError, EvalConfig, PromptTemplate, RewardConfig,
                                      choices)
from minisparse.engine.backend import RolloutBackend
from minisparse.engine.config import SamplingParams
from minisparse.data.synthetic import user_prompt

# The paper's default prompt: the question, this instruction, no chat template.
BOXED_INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}.\n\n"
# The training set's turn (simplelr_qwen_level3to5.jsonl), doubled braces as published:
# the model saw exactly this during RL, so the chat template repeats it verbatim.
CHAT_SYSTEM = "You are a helpful assistant."
CHAT_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{{}}."
PROMPT_TEMPLATES = choices(PromptTemplate)


class ResultsMismatchError(ValueError):
    """The output directory holds finished results made with different settings."""


def _alone(obj: Any) -> list[Any]:
    return [obj]


@dataclass(frozen=True)
class Shard:
    """This process's part of an evaluation split over `world` processes (train.py's
    ranks): a contiguous block of each benchmark's problems, sampled with the seeds they
    have in one whole call, then gathered in rank order, so every rank ends with the
    records and scores a single process would have. Only rank 0 writes files."""

    rank: int = 0
    world: int = 1
    gather: Callable[[Any], list[Any]] = _alone  # every rank's object, in rank order

    def bounds(self, count: int) -> tuple[int, int]:
        """[start, end) of this rank's block of `count` items (sizes differ by <= 1)."""
        base, extra = divmod(count, self.world)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + int(self.rank < extra)


# ------------------------------------------------------------------------------ prompts


def check_prompt_template(tokenizer: Any, template: str) -> None:
    """Fail before generation when the template is unknown or the tokenizer cannot do it."""
    if template not in PROMPT_TEMPLATES:
        raise ConfigError(f"unknown prompt template '{template}'; use one of {PROMPT_TEMPLATES}")
    if template in ("chat", "user") and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template; use --prompt-template boxed")


def prompt_text(tokenizer: Any, question: str, template: str) -> str:
    """The prompt string the model sees for one question."""
    if template == "boxed":
        return question + BOXED_INSTRUCTION
    if template == "user":  # a training row of data.path=synthetic with apply_chat_template
        return tokenizer.apply_chat_template([{"role": "user", "content": user_prompt(question)}],
                                             tokenize=False, add_generation_prompt=True)
    messages = [
        {"role": "system", "content": CHAT_SYSTEM},
        {"role": "user", "content": question + CHAT_INSTRUCTION},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer: Any, question: str, template: str) -> list[int]:
    """Token ids; special tokens (BOS) are added only where the chat template has none."""
    text = prompt_text(tokenizer, question, template)
    return list(tokenizer.encode(text, add_special_tokens=template == "boxed"))


def problem_prompt_ids(tokenizer: Any, problem: Problem, template: str) -> list[int]:
    """A training file's row keeps its own prompt; a benchmark's question takes the template."""
    if problem.prompt is not None:
        from minisparse.data.datasets import render_prompt

        return render_prompt(problem.prompt, tokenizer)
    return prompt_token_ids(tokenizer, problem.question, template)


# ------------------------------------------------------------------------------ metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def accuracy_ci95(per_problem: Sequence[float]) -> float | None:
    """Half-width of the 95% interval of the mean accuracy, the problems taken as a sample
    of their kind (normal approximation over per-problem accuracies: with n samples a
    problem, c/n each): 0.044 for 500 problems at 50% with one sample each."""
    count = len(per_problem)
    if count < 2:  # no spread to estimate from
        return None
    mean = sum(per_problem) / count
    variance = sum((x - mean) ** 2 for x in per_problem) / (count - 1)
    return 1.96 * math.sqrt(variance / count)


def pass_k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n."""
    return [2**i for i in range(n.bit_length()) if 2**i <= n]


def sample_metrics(records: Sequence[dict], n_samples: int) -> dict:
    """avg@n, pass@k, length, truncation and timeouts from per-sample records."""
    correct: dict[int, int] = {}
    for r in records:
        correct[r["problem_index"]] = correct.get(r["problem_index"], 0) + int(r["correct"])
    total = len(records)
    metrics = {
        "problems": len(correct),
        "samples": total,
        "accuracy": sum(int(r["correct"]) for r in records) / total,
        "accuracy_ci95": accuracy_ci95([c / n_samples for c in correct.values()]),
        "pass_at_k": {
            f"pass@{k}": sum(pass_at_k(n_samples, c, k) for c in correct.values()) / len(correct)
            for k in pass_k_values(n_samples)
        },
        "mean_response_tokens": sum(r["tokens"] for r in records) / total,
        "truncated_fraction": sum(r["finish_reason"] == "length" for r in records) / total,
        "grading_timeouts": sum(bool(r["grading_timed_out"]) for r in records),
    }
    if any("num_compressions" in r for r in records):
        metrics["mean_compressions"] = sum(r.get("num_compressions", 0) for r in records) / total
    return metrics


def _stats_dict(stats: Any) -> dict:
    """The engine's GenerateStats (a dataclass or object) as a JSON-friendly dict."""
    if stats is None:
        return {}
    raw = asdict(stats) if is_dataclass(stats) else dict(vars(stats))
    return {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool))}


# ------------------------------------------------------------------------------ generation


def _record(problem: Problem, out: Any, response: str, grade: Any) -> dict:
    record = {
        "problem_index": problem.index,
        "sample_index": out.sample_index,
        "question": problem.question,
        "ground_truth": problem.answer,
        "response": response,
        "extracted_answer": grade.answer,
        "correct": grade.score > 0.5,
        "score": grade.score,
        "grading_timed_out": grade.timed_out,
        "tokens": len(out.token_ids),
        "finish_reason": out.finish_reason,
    }
    for key in ("num_compressions", "evicted_tokens", "peak_cache_tokens"):
        if getattr(out, key, None) is not None:
            record[key] = getattr(out, key)
    return record


def _generate_and_grade(
    engine: RolloutBackend, tokenizer: Any, problems: Sequence[Problem], params: SamplingParams,
    template: str, progress: bool, reward: RewardConfig,
) -> tuple[list[dict], dict]:
    """One process's problems: n samples each, graded by the math grader as `reward` says
    (workers, timeout_s); (records, timing stats)."""
    from minisparse.data.reward import grade_batch

    if not problems:  # more ranks than problems
        return [], {"generation_s": 0.0, "generated_tokens": 0, "grading_s": 0.0, "engine": {}}
    prompts = [problem_prompt_ids(tokenizer, p, template) for p in problems]
    start = time.perf_counter()
    outs = engine.generate(prompts, params, progress=progress)
    gen_s = time.perf_counter() - start
    responses = [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    start = time.perf_counter()
    grades, _ = grade_batch(responses, [problems[o.prompt_index].answer for o in outs],
                            timeout_s=reward.timeout_s, workers=reward.workers)
    grade_s = time.perf_counter() - start
    records = [_record(problems[o.prompt_index], o, r, g)
               for o, r, g in zip(outs, responses, grades)]
    timing = {
        "generation_s": gen_s,
        "generated_tokens": sum(r["tokens"] for r in records),
        "grading_s": grade_s,
        "engine": _stats_dict(getattr(engine, "last_stats", None)),
    }
    return records, timing


def run_benchmark(
    engine: RolloutBackend, tokenizer: Any, problems: Sequence[Problem], params: SamplingParams,
    template: str, progress: bool = True, shard: Shard = Shard(),
    reward: RewardConfig | None = None,
) -> tuple[list[dict], dict]:
    """Generate n samples per problem, grade them (reward.workers processes, reward.timeout_s
    per answer; None: the defaults); (per-sample records, timing stats).
    Split over shard.world processes, each generates and grades its block (every rank
    calls this); the wall time is the slowest rank's, the engine stats rank 0's."""
    start, end = shard.bounds(len(problems))
    params = replace(params, seed_offset=params.seed_offset + start * params.n)
    parts = shard.gather(
        _generate_and_grade(engine, tokenizer, problems[start:end], params, template, progress,
                            reward or RewardConfig())
    )
    records = [r for part, _ in parts for r in part]
    gen_s = max(t["generation_s"] for _, t in parts)
    tokens = sum(t["generated_tokens"] for _, t in parts)
    timing = {
        "generation_s": gen_s,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "grading_s": max(t["grading_s"] for _, t in parts),
        "engine": parts[0][1]["engine"],
    }
    if shard.world > 1:
        timing["ranks"] = shard.world
    return records, timing


# ------------------------------------------------------------------------------ files


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write through a temporary file and rename, so a killed run leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide results from other users
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any) -> None:
    _atomic_write(path, lambda f: json.dump(obj, f, indent=2, ensure_ascii=False))


def write_benchmark_results(bench_dir: Path, records: Sequence[dict], result: dict) -> None:
    """samples.jsonl first, metrics.json last: metrics.json marks the benchmark finished."""
    def write_lines(f: Any) -> None:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    _atomic_write(bench_dir / "samples.jsonl", write_lines)
    write_json(bench_dir / "metrics.json", result)


def load_finished(bench_dir: Path, settings: dict) -> dict | None:
    """The saved result of a finished benchmark, None if unfinished; mismatch raises."""
    metrics_path = bench_dir / "metrics.json"
    if not (metrics_path.is_file() and (bench_dir / "samples.jsonl").is_file()):
        return None
    saved = json.loads(metrics_path.read_text(encoding="utf-8"))
    if saved.get("settings") != settings:
        differ = sorted(k for k in set(settings) | set(saved.get("settings", {}))
                        if settings.get(k) != saved.get("settings", {}).get(k))
        raise ResultsMismatchError(
            f"{metrics_path} holds results made with other settings (differ: "
            f"{', '.join(differ)}); pass --overwrite or choose another output directory"
        )
    return saved


# ------------------------------------------------------------------------------ driver


def protocol_for(name: str, eval_cfg: EvalConfig) -> tuple[int, int]:
    """(n_samples, max_new_tokens): the config's value when set, else the paper's. `name`
    is a loaded benchmark's key: a training file's is its stem."""
    spec = get_spec(name) if name in REGISTRY else TRAINING_FILE
    n, max_new = eval_cfg.n_samples, eval_cfg.max_new_tokens
    return (spec.n_samples if n is None else n,
            spec.max_new_tokens if max_new is None else max_new)


def _json_normal(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _plan(
    problems: dict[str, list[Problem]], eval_cfg: EvalConfig, common: dict,
    output_dir: str | Path | None, overwrite: bool,
) -> list[tuple[str, dict, Path | None, dict | None]]:
    """(name, settings, folder, saved result or None) per benchmark. Runs before any
    generation, so a mismatch with results already in output_dir fails early."""
    plan = []
    for name in problems:
        n, max_new = protocol_for(name, eval_cfg)
        bench_settings = {**common, "n_samples": n, "max_new_tokens": max_new}
        bench_dir = Path(output_dir) / name if output_dir is not None else None
        saved = None
        if bench_dir is not None and not overwrite:
            saved = load_finished(bench_dir, bench_settings)
        plan.append((name, bench_settings, bench_dir, saved))
    return plan


def _score_benchmark(
    engine: RolloutBackend, tokenizer: Any, eval_cfg: EvalConfig, problems: list[Problem],
    bench_settings: dict, bench_dir: Path | None, progress: bool, shard: Shard,
    reward: RewardConfig | None,
) -> dict:
    """Generate, grade and (with a folder, on rank 0) write one benchmark; its metrics."""
    n, max_new = bench_settings["n_samples"], bench_settings["max_new_tokens"]
    params = SamplingParams.from_config(eval_cfg, n, max_new, bench_settings["seed"])
    records, timing = run_benchmark(
        engine, tokenizer, problems, params, eval_cfg.prompt_template, progress, shard,
        reward,
    )
    metrics = {"n_samples": n, "max_new_tokens": max_new, **sample_metrics(records, n), **timing}
    if bench_dir is not None and shard.rank == 0:
        result = {"settings": bench_settings, "metrics": metrics}
        write_benchmark_results(bench_dir, records, result)
    return metrics


def evaluate(
    engine: RolloutBackend, tokenizer: Any, eval_cfg: EvalConfig,
    output_dir: str | Path | None = None, *,
    settings: dict | None = None, seed: int | None = None, overwrite: bool = False,
    progress: bool = True, problems: dict[str, list[Problem]] | None = None,
    log: Callable[[str], None] = print, shard: Shard = Shard(),
    reward: RewardConfig | None = None,
) -> dict:
    """Score eval_cfg.benchmarks (empty: the paper's seven) with `engine`; the summary dict.

    `settings` (model, compression, ...) is recorded with every result and must match for
    a finished benchmark in output_dir to be reused. `problems` skips re-reading files
    that the caller already validated. n_samples / max_new_tokens of None in eval_cfg
    select the per-benchmark protocol (32 samples and 16,384 tokens for aime24, amc23).
    With a Shard every rank calls this and gets the same summary (see Shard).
    reward: how each benchmark's responses are graded (reward.workers processes,
    reward.timeout_s per answer; its function is not used: benchmarks take the math grader).
    """
    check_prompt_template(tokenizer, eval_cfg.prompt_template)
    if problems is None:
        problems = load_benchmarks(eval_cfg.benchmarks, eval_cfg.data_dir, eval_cfg.limit)
    common = _json_normal({
        **(settings or {}), "prompt_template": eval_cfg.prompt_template,
        "temperature": eval_cfg.temperature, "top_p": eval_cfg.top_p, "seed": seed,
        "limit": eval_cfg.limit,
    })
    results: dict[str, dict] = {}
    for name, bench_settings, bench_dir, saved in _plan(problems, eval_cfg, common,
                                                         output_dir, overwrite):
        if saved is not None:
            log(f"[{name}] finished earlier in {bench_dir}, skipped (--overwrite to redo)")
            results[name] = saved["metrics"]
            continue
        log(f"[{name}] {len(problems[name])} problems x {bench_settings['n_samples']} samples, "
            f"<= {bench_settings['max_new_tokens']} new tokens")
        results[name] = _score_benchmark(engine, tokenizer, eval_cfg, problems[name],
                                         bench_settings, bench_dir, progress, shard,
                                         reward)
    summary = {
        "settings": common,
        "benchmarks": results,
        "average_accuracy": sum(m["accuracy"] for m in results.values()) / max(len(results), 1),
    }
    if output_dir is not None and shard.rank == 0:
        write_json(Path(output_dir) / "summary.json", summary)
    return summary


def flat_metrics(summary: dict, prefix: str = "eval") -> dict[str, float]:
    """{'eval/gsm8k/accuracy': ..., 'eval/average_accuracy': ...} for the training logger."""
    flat = {f"{prefix}/average_accuracy": summary["average_accuracy"]}
    for name, m in summary["benchmarks"].items():
        for key in ("accuracy", "accuracy_ci95", "mean_response_tokens", "truncated_fraction"):
            if m.get(key) is not None:  # one problem has no interval; older results none
                flat[f"{prefix}/{name}/{key}"] = m[key]
        for key, value in m["pass_at_k"].items():
            flat[f"{prefix}/{name}/{key}"] = value
    return flat


def _percent_with_interval(m: dict) -> str:
    ci = m.get("accuracy_ci95")
    return f"{100 * m['accuracy']:.1f}" + ("" if ci is None else f" +- {100 * ci:.1f}")


def format_table(summary: dict) -> str:
    """The per-benchmark table eval.py prints."""
    header = ("benchmark", "problems", "n", "avg@n", "pass@max", "mean len", "truncated",
              "timeouts", "gen s", "tok/s")
    rows = [header]
    for name, m in summary["benchmarks"].items():
        best_k = list(m["pass_at_k"])[-1]
        rows.append((
            name, str(m["problems"]), str(m["n_samples"]), _percent_with_interval(m),
            f"{100 * m['pass_at_k'][best_k]:.1f} ({best_k})", f"{m['mean_response_tokens']:.0f}",
            f"{100 * m['truncated_fraction']:.1f}%", str(m["grading_timeouts"]),
            f"{m['generation_s']:.1f}", f"{m['tokens_per_s']:.0f}",
        ))
    rows.append(("average", "", "", f"{100 * summary['average_accuracy']:.1f}") + ("",) * 6)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
