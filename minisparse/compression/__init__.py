"""KV-cache compression for sparse rollouts: selection rules (RKV, SnapKV), their batched
GPU path, and the triggers that decide when a sequence is compressed.
See docs/compression.md for the rules and how they map to the paper's code.
"""
from .policy import RKV, SnapKV, build_policy
from .trigger import compress_due, max_buffer, max_cache_tokens, newline_token_ids

__all__ = [
    "RKV",
    "SnapKV",
    "build_policy",
    "compress_due",
    "max_buffer",
    "max_cache_tokens",
    "newline_token_ids",
]
