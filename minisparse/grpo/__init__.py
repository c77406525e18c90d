"""GRPO with the Sparse-RL corrections: the algorithm alone, as functions of tensors.

Read in the order a rollout uses it:
  batch             a prompt's n samples and their rewards (the group GRPO compares)
  rewards           DAPO's overlong penalty: the grader's scores into rewards
  dynamic_sampling  draw again until groups carry signal (DAPO's dynamic sampling)
  advantages        each sample's advantage against its group (or the batch)
  mismatch          how far the sampler (a compressed KV cache) is from the dense policy
  corrections       Sparse-RL: importance weights, rejection, veto, normalisation
  loss              PPO clip, KL to the reference, entropy, aggregation
  objective         one micro-batch's loss, from the rollout batch and the current log-probs

How a policy is stepped on that loss (backward, micro-batches, ranks, the memory plan,
checkpoints, logging) is minisparse.trainer's; train.py joins the two. Sampling and
grading are the engine's and the grader's (minisparse/rollout.py hands their output over).

A function that needs a value over every rank's samples (the batch whitening, the
weights' normalisation, dynamic sampling's rounds) takes the collective as `reduce`:
one process by default (`alone`), torch.distributed's in train.py, so each is testable
alone with hand-computed numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[..., torch.Tensor]  # reduce(tensor, op="sum" | "max") over all ranks


def alone(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The reduction over one process: the tensor itself."""
    return tensor
