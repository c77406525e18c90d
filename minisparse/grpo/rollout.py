"""One rollout batch: engine samples turned into the padded tensors the update reads.

Per-token tensors are [N, T] (N samples of this rank, prompt-major in groups of
n_samples_per_prompt; T the longest response), zero past each response's end, with
response_mask marking real tokens. Later phases fill in old/ref log-probs, advantages,
and the correction weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from minisparse.config.schema import Config, RewardConfig
from minisparse.data.datasets import PromptRow
from minisparse.engine.config import SamplingParams
from minisparse.utils.distributed import Max


@dataclass
class RolloutBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    labels: list[str]
    finish_reasons: list[str]
    rollout_logp: torch.Tensor  # [N, T] sampler log-probs (compressed KV cache)
    response_mask: torch.Tensor  # [N, T] bool
    num_compressions: list[int]
    evicted_tokens: list[int]
    peak_cache_tokens: list[int]
    compressed_tokens: list[int]  # per sample: tokens sampled from a cache that had evicted
    rewards: torch.Tensor | None = None  # [N] what the advantages see (after reward shaping)
    scores: torch.Tensor | None = None  # [N] the grader's (or plug-in's), before shaping
    advantages: torch.Tensor | None = None  # [N]
    old_logp: torch.Tensor | None = None  # [N, T] dense policy before the update
    ref_logp: torch.Tensor | None = None  # [N, T] frozen reference policy
    weights: torch.Tensor | None = None  # [N, T] Sparse-RL importance weights
    keep: torch.Tensor | None = None  # [N, T] bool, tokens that stay in the loss
    metadata: list[dict] = field(default_factory=list)  # per sample, for a reward plug-in
    grade_stats: dict | None = None  # the grader's stats, once rewards are in

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def width(self) -> int:
        return self.response_mask.shape[1]


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


def take_samples(batches: list[RolloutBatch], picks: list[tuple[int, int]]) -> RolloutBatch:
    """A new batch of the samples picks = [(batch number, sample index)], in that order,
    with what the rollout and reward filled in (padded to its own longest response)."""
    width = max([len(batches[b].responses[i]) for b, i in picks] + [1])
    values: dict = {}
    for f in fields(RolloutBatch):
        first = getattr(batches[0], f.name)
        if isinstance(first, list):
            values[f.name] = [getattr(batches[b], f.name)[i] for b, i in picks]
        elif isinstance(first, torch.Tensor) and first.dim() == 1:
            values[f.name] = torch.stack([getattr(batches[b], f.name)[i] for b, i in picks])
        elif isinstance(first, torch.Tensor):
            out = first.new_zeros(len(picks), width)
            for row, (b, i) in enumerate(picks):
                n = min(width, getattr(batches[b], f.name).shape[1])
                out[row, :n] = getattr(batches[b], f.name)[i, :n]
            values[f.name] = out
    return RolloutBatch(**values)


def generate_metrics(stats: list) -> dict[str, float]:
    """perf/* of the engine's generate calls of one rollout (several with dynamic
    sampling): tokens and preemptions summed, throughput over their summed time; the
    device time of prefill, decode and compaction summed, so a compressed run's records
    say what its compression costs (the rest of the rollout's wall time waited on the
    host); the pages held at once, which prompt sharing lowers where token counts do
    not see it; and whether the fast path ran (the share of decode steps replayed from
    CUDA graphs, 1.0 when every call's forward took the fused kernels)."""
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
        "perf/rollout_decode_s": sum(s.decode_s for s in stats),
        "perf/rollout_compress_s": sum(s.compress_s for s in stats),
        "perf/decode_graph_share": graph_steps / decode_steps if decode_steps else 0.0,
        "perf/fused_kernels": float(all(s.fused_kernels for s in stats)),
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _graded(batch: RolloutBatch) -> torch.Tensor:
    return batch.scores if batch.scores is not None else batch.rewards


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Reward, length, truncation and compression statistics of one rollout batch, with
    the grader's (batch.grade_stats) as reward/*."""
    lengths = [len(r) for r in batch.responses]
    metrics = {
        "rollout/reward_mean": batch.rewards.mean().item(),
        "rollout/accuracy": (_graded(batch) > 0.5).float().mean().item(),
        "rollout/response_len_mean": _mean(lengths),
        "rollout/response_len_max": Max(max(lengths, default=0)),
        "rollout/truncated_frac": _mean([float(f == "length") for f in batch.finish_reasons]),
        "rollout/aborted_frac": _mean([float(f == "abort") for f in batch.finish_reasons]),
        "compress/compressions_per_sample": _mean(batch.num_compressions),
        "compress/evicted_tokens_per_sample": _mean(batch.evicted_tokens),
        "compress/peak_cache_tokens_mean": _mean(batch.peak_cache_tokens),
        "compress/peak_cache_tokens_max": Max(max(batch.peak_cache_tokens, default=0)),
        # the share of response tokens sampled after their sequence's first eviction: with
        # the mismatch KL, whether compression acts enough for the corrections to matter
        "compress/compressed_token_frac": sum(batch.compressed_tokens) / max(sum(lengths), 1),
    }
    for key, value in (batch.grade_stats or {}).items():
        if isinstance(value, (int, float)):
            metrics[f"reward/{key}"] = float(value)
    return metrics


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, as a positive amount to subtract: 0 up to
    max_len - buffer tokens, then rising linearly to `penalty` at max_len, so a response
    is told to finish before it is cut off rather than only when it is."""
    over = (lengths.float() - (max_len - buffer)).clamp(min=0) / max(buffer, 1)
    return penalty * over.clamp(max=1.0)


def score_batch(batch: RolloutBatch, tokenizer, cfg: RewardConfig,
                max_response_len: int | None = None) -> dict:
    """Decode responses and grade them: with the plug-in cfg.function when set, else with
    minisparse.data.reward in cfg.workers processes, cfg.timeout_s per answer. Fills
    batch.scores (the grades), batch.rewards (the grades less the overlong penalty when
    cfg.overlong_buffer is set, which needs max_response_len) and batch.grade_stats
    (accuracy, grade_s; the math grader adds timeouts, over_budget and no_answer)."""
    texts = tokenizer.batch_decode(batch.responses, skip_special_tokens=True)
    if cfg.function:
        from minisparse.data.reward_plugin import call_reward_function

        scores, stats = call_reward_function(cfg.function, texts, batch.labels, batch.metadata)
    else:
        from minisparse.data.reward import grade_batch

        grades, stats = grade_batch(texts, batch.labels, timeout_s=cfg.timeout_s,
                                    workers=cfg.workers)
        scores = [g.score for g in grades]
    batch.scores = torch.tensor(scores, dtype=torch.float32)
    batch.rewards = batch.scores.clone()
    batch.grade_stats = dict(stats)
    if cfg.overlong_buffer:
        if max_response_len is None:
            raise ValueError("reward.overlong_buffer is set: score_batch needs max_response_len")
        lengths = torch.tensor([len(r) for r in batch.responses])
        penalty = overlong_penalty(lengths, max_response_len, cfg.overlong_buffer,
                                   cfg.overlong_penalty)
        batch.rewards -= penalty
        batch.grade_stats["overlong_penalty_mean"] = penalty.mean().item()
        batch.grade_stats["overlong_penalized_frac"] = (penalty > 0).float().mean().item()
    return batch.grade_stats
