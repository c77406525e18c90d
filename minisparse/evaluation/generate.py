"""A benchmark's samples, generated and graded: n samples a problem through the rollout
engine, each graded by minisparse.data.reward (math-verify) into a record; split over the
ranks of a training run when there are several (Shard), every rank ending with the records
one process would have made. How many samples of how many tokens is the benchmark's
protocol (protocol_for) unless eval settings say otherwise."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from typing import Any

from minisparse.config.schema import EvalConfig, RewardConfig
from minisparse.data.benchmarks import REGISTRY, TRAINING_FILE, Problem, get_spec
from minisparse.engine.backend import RolloutBackend
from minisparse.engine.config import SamplingParams


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


def protocol_for(name: str, eval_cfg: EvalConfig) -> tuple[int, int]:
    """(n_samples, max_new_tokens): the config's value when set, else the paper's. `name`
    is a loaded benchmark's key: a training file's is its stem."""
    spec = get_spec(name) if name in REGISTRY else TRAINING_FILE
    n, max_new = eval_cfg.n_samples, eval_cfg.max_new_tokens
    return (spec.n_samples if n is None else n,
            spec.max_new_tokens if max_new is None else max_new)


def _stats_dict(stats: Any) -> dict:
    """The engine's GenerateStats (a dataclass or object) as a JSON-friendly dict."""
    if stats is None:
        return {}
    raw = asdict(stats) if is_dataclass(stats) else dict(vars(stats))
    return {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool))}


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


def _generate_and_grade_block(
    llm: RolloutBackend, tokenizer: Any, problems: Sequence[Problem],
    prompts: Sequence[list[int]], params: SamplingParams, reward: RewardConfig, progress: bool,
) -> tuple[list[dict], dict]:
    """One process's problems: n samples each, graded by the math grader as `reward` says
    (workers, timeout_s); (records, timing stats)."""
    from minisparse.data.reward import grade_batch

    if not problems:  # more ranks than problems
        return [], {"generation_s": 0.0, "generated_tokens": 0, "grading_s": 0.0, "engine": {}}
    start = time.perf_counter()
    outs = llm.generate(list(prompts), params, progress=progress)
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
        "engine": _stats_dict(getattr(llm, "last_stats", None)),
    }
    return records, timing


def generate_and_grade(
    llm: RolloutBackend, tokenizer: Any, problems: Sequence[Problem],
    prompts: Sequence[list[int]], params: SamplingParams, reward: RewardConfig | None = None,
    progress: bool = True, shard: Shard = Shard(),
) -> tuple[list[dict], dict]:
    """params.n samples of each problem from its prompt, graded (reward.workers processes,
    reward.timeout_s per answer; None: the defaults); (per-sample records, timing stats).
    Split over shard.world processes, each generates and grades its block (every rank
    calls this); the wall time is the slowest rank's, the engine stats rank 0's."""
    start, end = shard.bounds(len(problems))
    params = replace(params, seed_offset=params.seed_offset + start * params.n)
    parts = shard.gather(_generate_and_grade_block(
        llm, tokenizer, problems[start:end], prompts[start:end], params,
        reward or RewardConfig(), progress))
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
