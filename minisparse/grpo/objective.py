"""A micro-batch's GRPO loss from the rollout batch: the rows of what the earlier phases
put in it (dense old and reference log-probs, advantages, Sparse-RL weights and kept
tokens), moved to the current log-probs' device and handed to `grpo_loss` (loss.py says
what it computes and why its denominator spans the step).
"""

from __future__ import annotations

import torch

from minisparse.config.schema import LossConfig
from minisparse.grpo.batch import RolloutBatch
from minisparse.grpo.loss import grpo_loss
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
