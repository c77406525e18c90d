"""The GRPO objective of one micro-batch: the current policy's log-probs of some samples of
a rollout batch against what the earlier phases put in it (dense old and reference
log-probs, advantages, Sparse-RL weights and kept tokens), through `grpo_loss`.

`denominator` is the step's count (loss.step_denominator over all of the step's samples)
shared over the ranks, so the micro-batch losses of a step sum to its mean: the trainer
adds them up through backward and takes one optimizer step (trainer/update.py).
"""

from __future__ import annotations

import torch

from minisparse.config.schema import LossConfig
from minisparse.grpo.loss import grpo_loss
from minisparse.grpo.batch import RolloutBatch
from minisparse.utils.transfer import to_device


def _rows(t: torch.Tensor | None, rows: list[int], device: torch.device) -> torch.Tensor | None:
    return None if t is None else to_device(t[rows], device)


def micro_batch_loss(logp: torch.Tensor, entropy: torch.Tensor | None, batch: RolloutBatch,
                     rows: list[int], cfg: LossConfig,
                     denominator: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of the samples `rows` of batch, whose current log-probs (and
    entropies) are logp [len(rows), T]; the batch's tensors follow logp to its device."""
    device = logp.device
    return grpo_loss(
        logp,
        _rows(batch.old_logp, rows, device),
        _rows(batch.advantages, rows, device),
        _rows(batch.weights, rows, device),
        _rows(batch.keep, rows, device),
        cfg,
        denominator,
        _rows(batch.ref_logp, rows, device),
        entropy,
    )
