"""Token-budget micro-batches: sequences packed into one row, no padding.

A rollout's sequence lengths vary by an order of magnitude, so fixed-size micro-batches
either waste memory on padding or overflow on the long ones. We pack whole sequences
(first-fit decreasing) into micro-batches of at most max_tokens tokens; the forward pass
sees one row with position_ids restarting per sequence (see logprobs.py).
"""

from __future__ import annotations

import torch

from minisparse.utils.distributed import all_reduce


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that each group's total length is <= max_tokens.

    First-fit decreasing; a sequence longer than max_tokens gets a group of its own (it
    cannot be split). Groups list indices in ascending order; every index appears once.
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def split_steps(num_samples: int, num_steps: int) -> list[list[int]]:
    """Sample indices of each optimizer step: consecutive, equal-sized chunks."""
    if num_samples % num_steps:
        raise ValueError(f"{num_samples} samples do not split into {num_steps} steps")
    size = num_samples // num_steps
    return [list(range(s * size, (s + 1) * size)) for s in range(num_steps)]


def step_micro_batches(lengths: list[int], num_steps: int,
                       max_tokens: int) -> list[list[list[int]]]:
    """Each optimizer step's micro-batches, as indices into lengths: the step's samples
    (split_steps) packed by tokens. The update runs them; the memory plan sizes them."""
    steps = []
    for samples in split_steps(len(lengths), num_steps):
        groups = pack_by_tokens([lengths[i] for i in samples], max_tokens)
        steps.append([[samples[i] for i in group] for group in groups])
    return steps


def equalize_across_ranks(groups: list[list[int]]) -> list[list[int]]:
    """Pad with empty groups so every rank runs the same number of micro-batches.

    Under ZeRO 2/3 each backward reduces gradients collectively, so ranks must take
    the same number of backward passes; an empty group runs a zero-loss backward.
    """
    count = all_reduce(torch.tensor([len(groups)], dtype=torch.long), op="max")
    return groups + [[] for _ in range(int(count.item()) - len(groups))]
