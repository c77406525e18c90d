"""Engine settings (EngineArgs) and per-call sampling settings (SamplingParams).

EngineArgs is what the engine needs from the run config (cfg.engine + cfg.compress), kept
as its own small dataclass so benches and tests can build an engine without a full Config.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisparse.config import CompressConfig, Config


@dataclass
class EngineArgs:
    page_size: int = 16
    kv_memory_gb: float = 0.0  # > 0: exact pool size in GiB
    kv_memory_fraction: float = 0.8  # else: fraction of free GPU memory
    kv_cpu_memory_gb: float = 1.0  # CPU: pool size is kv_memory_fraction of this
    max_num_seqs: int = 512
    max_prefill_tokens: int = 16384
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    cuda_graphs: bool = True
    compress: CompressConfig = field(default_factory=CompressConfig)
    device: torch.device | str = "cpu"

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device | str) -> EngineArgs:
        """Engine settings for a run: pool, scheduler and compression come from the config."""
        e = cfg.engine
        return cls(page_size=e.page_size, kv_memory_gb=e.kv_memory_gb,
                   kv_memory_fraction=e.kv_memory_fraction, kv_cpu_memory_gb=e.kv_cpu_memory_gb,
                   max_num_seqs=e.max_num_seqs, max_prefill_tokens=e.max_prefill_tokens,
                   cuda_graphs=e.cuda_graphs, compress=cfg.compress, device=device)

    @property
    def compression_on(self) -> bool:
        return self.compress is not None and self.compress.algorithm != "none"


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
