"""KV-cache compression for sparse rollouts: selection rules (the shipped ones one file
each in rules/: R-KV, SnapKV, ...; a user's own in their module, module.path:ClassName),
their batched GPU path, and the triggers that decide when a sequence is compressed. See
docs/compression.md for the rules and how to write one.
"""
from .rule import RuleError, ScoringRule, build_rule, check_rule, rule_class
from .rules.rkv import RKV
from .rules.snapkv import SnapKV
from .trigger import (compress_due, evictable_len, max_buffer, max_cache_tokens,
                      newline_token_ids)

__all__ = [
    "RKV",
    "RuleError",
    "ScoringRule",
    "SnapKV",
    "build_rule",
    "check_rule",
    "compress_due",
    "evictable_len",
    "max_buffer",
    "max_cache_tokens",
    "newline_token_ids",
    "rule_class",
]
