"""The update phase: num_steps_per_rollout optimizer steps over one rollout batch.

Each step takes its share of samples, packs them into token-budget micro-batches, runs
forward + loss + backward per micro-batch, then one DeepSpeed step. The loss divisor
is the step's global count (kept tokens or samples, summed over ranks) divided by the
world size, because DeepSpeed averages gradients over ranks: the result is exactly the
mean over all ranks' samples.

A non-finite loss poisons the step's gradients with NaN, so DeepSpeed's overflow check
(all-reduced over ranks) skips the step on every rank at once; such steps are counted.
Whether a loss was finite is gathered on the GPU and read once, after a step's
micro-batches: a read after each would make the host wait for each forward before it
launches the backward, and leave the GPU idle while it prepares the next micro-batch.
"""

from __future__ import annotations

import math

import torch

from minisparse.config.schema import Config
from minisparse.trainer.batching import equalize_across_ranks, step_micro_batches
from minisparse.utils.distributed import all_reduce, world_size
from minisparse.trainer.logprobs import response_logprobs
from minisparse.grpo.loss import grpo_loss, step_denominator
from minisparse.trainer.memory.phases import TrainingStateOffload, timed
from minisparse.grpo.rollout import RolloutBatch
from minisparse.utils.transfer import to_device


def _rows(t: torch.Tensor | None, rows: list[int], device: torch.device) -> torch.Tensor | None:
    return None if t is None else to_device(t[rows], device)


def _constant_backward(train_engine, scale: float) -> None:
    """A backward through one token whose gradients are `scale` times finite values:
    0 pads this rank to the others' micro-batch count, NaN poisons the step."""
    model = train_engine.module
    device = next(model.parameters()).device
    hidden = model.model(
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False
    ).last_hidden_state
    train_engine.backward(model.lm_head(hidden).sum() * scale, scale_wrt_gas=False)


def device_of(train_engine) -> torch.device:
    return next(train_engine.module.parameters()).device


def micro_batch_loss(model, batch: RolloutBatch, rows: list[int], cfg: Config, denominator: float):
    """(loss, metrics) of the samples `rows` of batch under the current policy."""
    device = next(model.parameters()).device
    entropy = "grad" if cfg.loss.entropy_coef > 0 else "detached"
    logp, ent = response_logprobs(
        model,
        [batch.prompts[i] for i in rows],
        [batch.responses[i] for i in rows],
        batch.width,
        entropy=entropy,
        temperature=cfg.temperature,
        chunk=cfg.model.logprob_chunk,
    )
    return grpo_loss(
        logp,
        _rows(batch.old_logp, rows, device),
        _rows(batch.advantages, rows, device),
        _rows(batch.weights, rows, device),
        _rows(batch.keep, rows, device),
        cfg.loss,
        denominator,
        _rows(batch.ref_logp, rows, device),
        ent,
    )


def optimizer_step(
    train_engine, batch: RolloutBatch, micro_batches: list[list[int]], cfg: Config,
    offload: TrainingStateOffload | None = None,
) -> dict[str, float]:
    """Forward/backward over micro-batches (rows of batch), then one optimizer step.
    offload: optimizer states wait on the CPU during the micro-batches (memory plan)."""
    samples = [i for rows in micro_batches for i in rows]
    local = step_denominator(batch.keep[samples], cfg.loss.aggregation)
    total = all_reduce(torch.tensor([local], dtype=torch.float64)).item()
    # DeepSpeed averages gradients over ranks, so each rank divides by total / world; the
    # clamp goes on the total (an empty step), never on the per-rank share.
    denominator = max(total, 1.0) / world_size()
    groups = equalize_across_ranks(micro_batches)
    sums: dict[str, torch.Tensor] = {}  # read once after the micro-batches: no sync each
    finite = torch.ones((), dtype=torch.bool, device=device_of(train_engine))
    if offload is not None:
        offload.offload_optimizer()
    for rows in groups:
        if not rows:
            _constant_backward(train_engine, 0.0)
            continue
        loss, metrics = micro_batch_loss(train_engine.module, batch, rows, cfg, denominator)
        finite &= torch.isfinite(loss)
        train_engine.backward(loss, scale_wrt_gas=False)
        for key, value in metrics.items():
            sums[key] = sums[key] + value if key in sums else value
    # every rank takes the poisoning backward when any rank saw a non-finite loss (ZeRO 2
    # reduces in each backward, so all ranks must take the same number)
    finite = bool(all_reduce(finite.float(), op="min").item())
    if not finite:
        _constant_backward(train_engine, float("nan"))
    if offload is not None:
        offload.reload()
    unreported = _norm_if_unreported(train_engine)
    step_s = timed(train_engine.step, device_of(train_engine))
    grad_norm = train_engine.get_global_grad_norm()
    grad_norm = unreported if grad_norm is None else float(grad_norm)
    applied = train_engine.was_step_applied() and finite and math.isfinite(grad_norm)
    return {
        **{key: float(value) for key, value in sums.items()},
        "train/grad_norm": grad_norm,
        "train/lr": train_engine.get_lr()[0],
        "train/micro_batches": float(len(groups)),
        "train/step_skipped": float(not applied),
        "time/optimizer_step_s": step_s,
    }


def _norm_if_unreported(train_engine) -> float:
    """The gradients' norm where DeepSpeed reports none (ZeRO 0 without a mixed-precision
    optimizer: fp32), taken before step() clips and zeroes them; their values are already
    the same on every rank then. NaN elsewhere: DeepSpeed's own norm is used."""
    if train_engine.zero_optimization_stage() != 0 or train_engine.bfloat16_enabled() \
            or train_engine.fp16_enabled():
        return float("nan")
    grads = [p.grad for p in train_engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g.float()) for g in grads]))) if grads else 0.0


def train_on_rollout(train_engine, batch: RolloutBatch, cfg: Config,
                     offload: TrainingStateOffload | None = None) -> list[dict[str, float]]:
    """Metrics of each of the num_steps_per_rollout optimizer steps."""
    train_engine.module.train()
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    return [
        optimizer_step(train_engine, batch, micro_batches, cfg, offload)
        for micro_batches in step_micro_batches(lengths, cfg.num_steps_per_rollout,
                                                cfg.max_tokens_per_gpu)
    ]
