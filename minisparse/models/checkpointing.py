"""Gradient checkpointing on some of a decoder's layers, the number the memory plan chose.

A checkpointed layer keeps only its input for the backward and runs its forward again
there: with every layer checkpointed an update does four forwards' work instead of
three. Where memory allows some layers to keep their activations, those skip the
recompute, so the plan checkpoints the fewest layers with which the update fits.
The first layers are the checkpointed ones: the backward reaches them last, after the
others have freed their activations, so their recompute never adds to the peak.
"""
from __future__ import annotations

from torch import nn


def checkpoint_layers(model: nn.Module, count: int | None) -> None:
    """Gradient checkpointing on the first `count` decoder layers of an HF causal LM (None:
    all of them; 0: off)."""
    if count == 0:
        model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if count is None:
        return
    layers = model.model.layers
    if not 0 < count <= len(layers):
        raise ValueError(f"{count} checkpointed layers asked of a model with {len(layers)}")
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < count


def checkpointed_count(model: nn.Module) -> int:
    """Decoder layers now under gradient checkpointing."""
    return sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in model.model.layers)
