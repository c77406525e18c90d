"""The rollout's hand-over between the machinery and the algorithm: the engine's samples
into grpo's RolloutBatch (with what a reward plug-in reads of each), the engine's
counters as perf/* metrics, and a batch graded (the math grader or reward.function) into
rewards, the math grader on a thread of its own while the log-probs are computed
(BackgroundGrading). train.py's rollout and reward phases call these; grpo/ stays tensors
alone.
"""

from __future__ import annotations

import threading

import torch

from minisparse.config.schema import Config, RewardConfig
from minisparse.data.datasets import PromptRow
from minisparse.engine.config import SamplingParams
from minisparse.grpo.batch import RolloutBatch
from minisparse.grpo.rewards import set_rewards


def sampling_params(cfg: Config, seed: int) -> SamplingParams:
    """n_samples_per_prompt responses of up to max_response_len tokens per prompt."""
    return SamplingParams.from_config(cfg, cfg.n_samples_per_prompt, cfg.max_response_len, seed)


def sample_metadata(row: PromptRow, sample_index: int) -> dict:
    """What a reward plug-in gets besides response and label (data/reward_plugin.py)."""
    return {"prompt": row.prompt_text, "index": row.index, "sample_index": sample_index,
            **row.extra}


def build_batch(outputs: list, rows: list[PromptRow]) -> RolloutBatch:
    """RolloutBatch from engine SampleOutputs (prompt-major) and the prompts' rows."""
    width = max([len(o.token_ids) for o in outputs] + [1])
    logp = torch.zeros(len(outputs), width)
    mask = torch.zeros(len(outputs), width, dtype=torch.bool)
    for i, o in enumerate(outputs):
        n = len(o.token_ids)
        logp[i, :n] = torch.tensor(o.logprobs[:n], dtype=torch.float32)
        mask[i, :n] = True
    return RolloutBatch(
        prompts=[list(o.prompt_token_ids) for o in outputs],
        responses=[list(o.token_ids) for o in outputs],
        labels=[rows[o.prompt_index].label for o in outputs],
        finish_reasons=[o.finish_reason for o in outputs],
        rollout_logp=logp,
        response_mask=mask,
        num_compressions=[o.num_compressions for o in outputs],
        evicted_tokens=[o.evicted_tokens for o in outputs],
        peak_cache_tokens=[o.peak_cache_tokens for o in outputs],
        compressed_tokens=[o.compressed_tokens for o in outputs],
        metadata=[sample_metadata(rows[o.prompt_index], o.sample_index) for o in outputs],
    )


def generate_metrics(stats: list) -> dict[str, float]:
    """perf/* of the engine's generate calls of one rollout (several with dynamic
    sampling): tokens and preemptions summed, throughput over their summed time; the
    device time of prefill, decode and compaction summed, so a compressed run's records
    say what its compression costs (the rest of the rollout's wall time waited on the
    host), the prefill steps (each a forward that breaks the decode graphs' run) and the
    compaction events (batched calls), so a cost per event can be set
    beside the profile's; the pages held at once, which prompt sharing lowers where token
    counts do not see it; and whether the fast path ran (the share of decode steps
    replayed from CUDA graphs, 1.0 when every call's forward took the fused kernels)."""
    tokens = sum(s.generated_tokens for s in stats)
    wall = sum(s.wall_s for s in stats)
    decode_steps = sum(s.decode_steps for s in stats)
    graph_steps = sum(s.graph_steps for s in stats)
    return {
        "perf/rollout_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "perf/rollout_tokens": float(tokens),
        "perf/peak_kv_tokens": float(max(s.peak_kv_tokens for s in stats)),
        "perf/peak_kv_pages": float(max(s.peak_pages_used for s in stats)),
        "perf/preemptions": float(sum(s.preemptions for s in stats)),
        "perf/rollout_prefill_s": sum(s.prefill_s for s in stats),
        "perf/prefill_steps": float(sum(s.prefill_steps for s in stats)),
        "perf/prefill_tokens": float(sum(s.prefill_tokens for s in stats)),
        "perf/shared_prompt_tokens": float(sum(s.shared_prompt_tokens for s in stats)),
        "perf/rollout_decode_s": sum(s.decode_s for s in stats),
        "perf/rollout_compress_s": sum(s.compress_s for s in stats),
        "perf/compress_events": float(sum(s.compress_events for s in stats)),
        "perf/decode_graph_share": graph_steps / decode_steps if decode_steps else 0.0,
        "perf/fused_kernels": float(all(s.fused_kernels for s in stats)),
    }


def grade_responses(batch: RolloutBatch, tokenizer,
                    cfg: RewardConfig) -> tuple[list[float], dict[str, float]]:
    """(score per response, the grader's stats: accuracy, grade_s; the math grader adds
    timeouts, over_budget and no_answer) of the decoded responses: with the plug-in
    cfg.function when set, else with minisparse.data.reward in cfg.workers processes,
    cfg.timeout_s per answer."""
    texts = tokenizer.batch_decode(batch.responses, skip_special_tokens=True)
    if cfg.function:
        from minisparse.data.reward_plugin import call_reward_function

        return call_reward_function(cfg.function, texts, batch.labels, batch.metadata)
    from minisparse.data.reward import grade_batch

    grades, stats = grade_batch(texts, batch.labels, timeout_s=cfg.timeout_s,
                                workers=cfg.workers)
    return [g.score for g in grades], stats


def score_batch(batch: RolloutBatch, tokenizer, cfg: RewardConfig,
                max_response_len: int | None = None) -> dict:
    """grade_responses, whose scores become the batch's rewards (grpo/rewards.py).
    Returns the grader's stats."""
    return set_rewards(batch, *grade_responses(batch, tokenizer, cfg), cfg, max_response_len)


class BackgroundGrading:
    """grade_responses of a rollout on a thread of its own, started as the rollout ends.

    Why: the log-prob passes do not need rewards, so the answers are read and graded
    (math-verify in its processes) while the GPU computes them, not before: on real
    answers grading took 0.3-2.6 s of a step's time (docs/benchmarks.md, "Grading while
    the log-probs run"). The processes are launched from the calling (main) thread, so
    they die with the trainer (data/grading_pool.py). The thread reads the batch and
    changes nothing; result() hands back what it made."""

    def __init__(self, batch: RolloutBatch, tokenizer, cfg: RewardConfig) -> None:
        from minisparse.data.reward import launch_grading_processes

        if not cfg.function:
            launch_grading_processes(cfg.workers)
        self._graded: tuple[list[float], dict[str, float]] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._grade, args=(batch, tokenizer, cfg),
                                        name="grading", daemon=True)
        self._thread.start()

    def _grade(self, batch: RolloutBatch, tokenizer, cfg: RewardConfig) -> None:
        try:
            self._graded = grade_responses(batch, tokenizer, cfg)
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            self._error = exc

    def result(self) -> tuple[list[float], dict[str, float]]:
        """grade_responses' scores and stats, once done; what it raised is raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._graded is not None
        return self._graded
