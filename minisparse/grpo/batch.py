"""One rollout batch: a prompt's samples as the padded tensors the update reads.

Per-token tensors are [N, T] (N samples of this rank, prompt-major in groups of
n_samples_per_prompt; T the longest response), zero past each response's end, with
response_mask marking real tokens. Later phases fill in old/ref log-probs, advantages,
and the correction weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

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
