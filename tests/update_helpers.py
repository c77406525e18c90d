"""For tests that run the update in-process: a rollout batch as the rollout phase leaves
it, and the gradients a DeepSpeed engine's steps apply."""
from __future__ import annotations

import torch

from minisparse.grpo.rollout import RolloutBatch


def rollout_batch(prompts: list[list[int]], responses: list[list[int]],
                  rollout_logp: torch.Tensor) -> RolloutBatch:
    """A RolloutBatch of these samples (no compression counters), rollout_logp zeroed past
    each response's end."""
    n = len(responses)
    mask = torch.zeros(n, rollout_logp.shape[1], dtype=torch.bool)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = True
    return RolloutBatch(prompts=prompts, responses=responses, labels=["1"] * n,
                        finish_reasons=["stop"] * n, rollout_logp=rollout_logp * mask,
                        response_mask=mask, num_compressions=[0] * n, evicted_tokens=[0] * n,
                        peak_cache_tokens=[0] * n, compressed_tokens=[0] * n)


def grads_at_step(engine) -> dict[str, torch.Tensor]:
    """The gradients each engine.step() is about to apply (ZeRO 0 keeps them in .grad,
    before clipping), filled in as the steps run."""
    grads: dict[str, torch.Tensor] = {}
    step = engine.step

    def recording_step(*args, **kwargs):
        grads.update({n: p.grad.detach().cpu().clone()
                      for n, p in engine.module.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    engine.step = recording_step
    return grads
