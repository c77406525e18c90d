"""The rollout-backend protocol the trainer and evaluator program against, so an embedded
SGLang engine can stand in for the native engine on dense runs."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from minisparse.engine.config import SamplingParams
from minisparse.engine.sequence import SampleOutput


@runtime_checkable
class RolloutBackend(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 progress: bool = False) -> list[SampleOutput]:
        """len(prompts) * params.n outputs, prompt-major."""
        ...

    def sleep(self) -> None:
        """Release generation memory (KV cache) for the training phase."""
        ...

    def wake(self) -> None:
        """Re-acquire what sleep() released."""
        ...

    def update_weights(self, model: nn.Module) -> None:
        """Generate with `model`'s (possibly new) parameters from now on."""
        ...
