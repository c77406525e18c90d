"""Per-call sampling settings (SamplingParams). The engine's own settings are the run
config's sections (minisparse.config.schema.EngineConfig and CompressConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from minisparse.config.schema import Config, EvalConfig


@dataclass
class SamplingParams:
    """How to sample. temperature 0 means greedy; its log-prob is then that of the argmax
    token under the T=1 distribution. Log-probs are always taken before top-p/top-k
    truncation, from log_softmax(logits / T) in float32."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    n: int = 1
    seed: int | None = None
    # Samples are seeded as if this call's came after seed_offset others of one seeded
    # call, so a batch split over processes samples what it would have sampled whole.
    seed_offset: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid SamplingParams: {self}")
        self.stop_token_ids = tuple(self.stop_token_ids)

    @classmethod
    def from_config(cls, cfg: Config | EvalConfig, n: int, max_new_tokens: int,
                    seed: int | None) -> SamplingParams:
        """Rollout sampling (a run Config) or benchmark sampling (an EvalConfig: no top-k)."""
        top_k = cfg.top_k if isinstance(cfg, Config) else -1
        return cls(temperature=cfg.temperature, top_p=cfg.top_p, top_k=top_k,
                   max_new_tokens=max_new_tokens, n=n, seed=seed)
