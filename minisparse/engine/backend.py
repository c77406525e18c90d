"""The rollout-backend protocol the trainer and evaluator program against, and the factory
that picks the backend a config names: the native engine (dense or compressed) or an
embedded SGLang engine (dense only)."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from minisparse.config.schema import Config, ConfigError
from minisparse.engine.config import SamplingParams
from minisparse.engine.sequence import GenerateStats, SampleOutput


@runtime_checkable
class RolloutBackend(Protocol):
    last_stats: GenerateStats  # of the last generate() call

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

    def dense(self) -> AbstractContextManager[None]:
        """Inside it, generate() keeps every token's K/V (no compression)."""
        ...


def check_backend(cfg: Config) -> None:
    """Fails before any model is loaded when this install cannot run cfg.engine.backend."""
    if cfg.engine.backend == "sglang":
        from minisparse.engine.sglang_backend import require_sglang

        require_sglang()


def make_backend(cfg: Config, model: nn.Module, tokenizer: Any,
                 device: torch.device | str) -> RolloutBackend:
    """The backend cfg.engine.backend names, over `model`'s current weights."""
    if cfg.engine.backend == "native":
        from minisparse.engine.engine import LLMEngine

        return LLMEngine(model, tokenizer, cfg.engine, cfg.compress, device)
    if cfg.engine.backend == "sglang":
        if cfg.compress.algorithm != "none":  # validate_config catches this first
            raise ConfigError("engine.backend=sglang is dense only (compress.algorithm=none)")
        from minisparse.engine.sglang_backend import SGLangBackend

        backend = SGLangBackend(model, tokenizer, cfg.engine, cfg.compress, device,
                                cfg.model.dtype, seed=cfg.seed)
        backend.update_weights(model)  # it starts on dummy weights
        return backend
    raise ConfigError(f"config key 'engine.backend': unknown backend {cfg.engine.backend!r}")
