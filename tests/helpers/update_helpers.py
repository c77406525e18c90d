"""For tests that run the update in-process: a rollout batch as the rollout phase leaves
it, train.py's update phase, and the gradients a DeepSpeed engine's steps apply."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from minisparse.config.schema import Config
from minisparse.grpo.batch import RolloutBatch
from minisparse.trainer.memory.choices import MemoryPlan


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


def grads_at_step(train_engine) -> dict[str, torch.Tensor]:
    """The gradients each train_engine.step() is about to apply (ZeRO 0 keeps them in
    .grad, before clipping), filled in as the steps run."""
    grads: dict[str, torch.Tensor] = {}
    step = train_engine.step

    def recording_step(*args, **kwargs):
        grads.update({n: p.grad.detach().cpu().clone()
                      for n, p in train_engine.module.named_parameters()
                      if p.grad is not None})
        return step(*args, **kwargs)

    train_engine.step = recording_step
    return grads


def update(train_engine, batch: RolloutBatch, cfg: Config, offload=None,
           update_tokens: int | None = None) -> dict[str, float]:
    """train.py's update phase: cfg.num_steps_per_rollout optimizer steps on batch, their
    metrics averaged (train/nonfinite_steps: the steps skipped); offload: what stands in
    for the optimizer state's moves where the memory plan offloads it; update_tokens: the
    plan's micro-batch budget (None: max_tokens_per_gpu, as an unplanned run's)."""
    import train

    tokens = cfg.max_tokens_per_gpu if update_tokens is None else update_tokens
    plan = MemoryPlan(gradient_checkpointing=False, optimizer_offload=offload is not None,
                      logprob_tokens=cfg.max_tokens_per_gpu, update_tokens=tokens)
    run = train.Run(cfg=cfg, device=None, train_engine=train_engine,
                    swaps=SimpleNamespace(offload=offload), reference=None, llm=None, plan=plan,
                    tokenizer=None, rows=[], sampler=None, logger=None)
    return train.update_phase(run, batch)
