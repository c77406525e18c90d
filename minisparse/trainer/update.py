"""One optimizer step over micro-batches, for any loss: forward + backward of each of this
rank's micro-batches, then DeepSpeed's step. The loss function is the algorithm's (train.py
hands GRPO's); what is here is how DeepSpeed is driven so that the step is exact and the
ranks stay in step:

* the loss function divides by the step's count over all ranks itself (`rank_share`), so
  summed micro-batch losses are the step's mean and DeepSpeed must not divide again
  (backward with scale_wrt_gas=False);
* every rank runs the same number of backwards (ZeRO 2 reduces gradients in each): a rank
  with fewer micro-batches pads with backwards whose gradients are 0;
* a non-finite loss on any rank poisons the step's gradients with NaN on every rank, so
  DeepSpeed's overflow check (all-reduced over ranks) skips the step everywhere at once.
  Whether a loss was finite is gathered on the GPU and read once, after the micro-batches:
  a read after each would make the host wait for each forward before it launches the
  backward, and leave the GPU idle while it prepares the next micro-batch;
* with optimizer offload (memory plan) the optimizer state waits on the CPU during the
  micro-batches and is back for the step;
* where DeepSpeed reports no gradient norm (ZeRO 0 in fp32), it is measured here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from minisparse.trainer.batching import equalize_across_ranks
from minisparse.trainer.measure import timed
from minisparse.trainer.memory.phases import TrainingStateOffload
from minisparse.utils.distributed import all_reduce, world_size

# a micro-batch's rows -> (loss, detached metrics that sum to the step's over micro-batches)
LossFn = Callable[[list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def rank_share(count: float) -> float:
    """What a loss summed over this rank's part of a step divides by, `count` being this
    rank's part of the step's count (tokens, samples): the count over all ranks divided by
    the number of ranks, since DeepSpeed averages gradients over ranks; the result is the
    mean over all ranks' samples. The clamp goes on the total (an empty step), never on a
    rank's share."""
    total = all_reduce(torch.tensor([count], dtype=torch.float64)).item()
    return max(total, 1.0) / world_size()


def device_of(train_engine) -> torch.device:
    return next(train_engine.module.parameters()).device


def _constant_backward(train_engine, scale: float) -> None:
    """A backward through one token whose gradients are `scale` times finite values:
    0 pads this rank to the others' micro-batch count, NaN poisons the step."""
    model = train_engine.module
    ids = torch.zeros(1, 1, dtype=torch.long, device=device_of(train_engine))
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    train_engine.backward(model.lm_head(hidden).sum() * scale, scale_wrt_gas=False)


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


def accumulate_and_step(train_engine, micro_batches: list[list[int]], loss_fn: LossFn,
                        offload: TrainingStateOffload | None = None) -> dict[str, float]:
    """loss_fn's forward and backward over this rank's micro-batches (lists of rows), then
    one optimizer step: the loss function's metrics summed over micro-batches, with the
    step's gradient norm, learning rate, micro-batch count, whether it was skipped (a
    non-finite loss or norm) and the optimizer step's seconds."""
    groups = equalize_across_ranks(micro_batches)
    sums: dict[str, torch.Tensor] = {}  # read once after the micro-batches: no sync each
    finite = torch.ones((), dtype=torch.bool, device=device_of(train_engine))
    if offload is not None:
        offload.offload_optimizer()
    for rows in groups:
        if not rows:
            _constant_backward(train_engine, 0.0)
            continue
        loss, metrics = loss_fn(rows)
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
