"""One sample being generated (Sequence), what a finished one returns (SampleOutput) and
the per-call statistics (GenerateStats)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum, auto


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class SampleOutput:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    num_compressions: int = 0
    evicted_tokens: int = 0
    peak_cache_tokens: int = 0
    compressed_tokens: int = 0  # tokens sampled from a cache that had lost evicted tokens


@dataclass
class GenerateStats:
    generated_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    peak_pages_used: int = 0
    peak_kv_tokens: int = 0  # whole pool: peak of the summed per-sequence cache lengths
    preemptions: int = 0
    compressions: int = 0
    evicted_tokens: int = 0
    prefill_tokens: int = 0
    shared_prompt_tokens: int = 0  # prompt tokens a sample took from a sibling's cache
    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens sampled by decode steps (one per running sequence)
    decode_kv_tokens: int = 0  # cache entries attended, summed over decode steps
    # Device time (CUDA-event time on CUDA, wall on CPU) of the step loop's phases; what
    # wall_s has beyond their sum is time the device waited for the host.
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compress_s: float = 0.0
    compress_events: int = 0  # batched compaction calls (each serves every due sequence)
    # Whether the fast path ran: decode steps replayed from a captured CUDA graph, and
    # whether the forward ran the fused Triton kernels (models.py's kernel path).
    graph_steps: int = 0
    fused_kernels: bool = False

    @property
    def prefill_steps(self) -> int:
        """Steps that prefilled (each an eager forward between runs of decode steps)."""
        return self.steps - self.decode_steps


@dataclass
class Sequence:
    """State of one sample. `num_computed` counts tokens whose K/V were computed (it is
    also the next RoPE position); `cache_len` counts the cache slots in use, which drops
    below num_computed once compression evicts tokens. A sequence is decoding when only
    its last sampled token is uncomputed."""
    seq_id: int
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    num_prompt: int
    seed: int
    stop_ids: frozenset[int] = frozenset()  # sampled tokens that end it ("stop")
    max_tokens: int = sys.maxsize  # token ids (prompt included) that end it ("length")
    status: Status = Status.WAITING
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1  # row in the runner's per-sequence state tensors, -1 when none
    pages: list[int] = field(default_factory=list)
    synced_pages: int = 0  # leading entries of `pages` already in the device page table
    num_computed: int = 0
    cache_len: int = 0
    num_compressions: int = 0
    evicted_tokens: int = 0
    peak_cache: int = 0
    compressed_tokens: int = 0
    finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def at_length(self, extra: int = 0) -> bool:
        """Whether it holds max_tokens token ids once `extra` more are appended."""
        return len(self.token_ids) + extra >= self.max_tokens

    def stop_reason(self, token: int) -> str | None:
        """How sampling `token` next ends it: "stop" (a stop token), "length" (it then holds
        max_tokens ids) or None (it goes on)."""
        if token in self.stop_ids:
            return "stop"
        return "length" if self.at_length(1) else None

    def append(self, token: int, logprob: float, cache_len: int) -> None:
        """The token sampled at a step where its cache held cache_len entries: fewer than
        the tokens so far means the step attended a compressed cache (after an eviction, and
        not after a preemption's dense recompute)."""
        if cache_len < len(self.token_ids):
            self.compressed_tokens += 1
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.peak_cache = max(self.peak_cache, cache_len)

    def advance(self, n: int) -> None:
        """n more tokens' K/V went into the cache (a prefill chunk, or a decode step's 1)."""
        self.num_computed += n
        self.cache_len += n

    def compacted(self, kept: int) -> int:
        """Its cache now holds `kept` entries; RoPE positions (num_computed) go on. Returns
        the entries evicted."""
        evicted = self.cache_len - kept
        self.evicted_tokens += evicted
        self.cache_len = kept
        self.num_compressions += 1
        return evicted

    def discount_compaction(self, evicted: int) -> None:
        """Take a compaction that evicted `evicted` entries off its counts: one that ran
        after its last token (an overlapped decode compacts before it reads the token
        that stops the sequence) changed nothing it sampled."""
        self.evicted_tokens -= evicted
        self.num_compressions -= 1

    def reset_cache(self) -> None:
        """Forget the KV cache (after preemption): everything is recomputed from tokens."""
        self.pages, self.slot, self.synced_pages = [], -1, 0
        self.num_computed = self.cache_len = 0
        self.status = Status.WAITING

    def to_output(self) -> SampleOutput:
        return SampleOutput(self.prompt_index, self.sample_index, self.token_ids[: self.num_prompt],
                            self.token_ids[self.num_prompt:], list(self.logprobs),
                            self.finish_reason or "abort", self.num_compressions,
                            self.evicted_tokens, self.peak_cache, self.compressed_tokens)
