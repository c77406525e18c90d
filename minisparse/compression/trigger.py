"""When a sequence's cache gets compressed: elementwise tensor rules, so the engine decides
for all running sequences at once without a per-sequence Python loop or a host sync.

The engine calls compress_due after each decode step's tokens are appended (and after a
prefill) with, per sequence, cache_len (tokens now in its cache, the same in every layer:
a compression leaves exactly `budget`) and, for the whole batch, step: the decode steps
the engine has run in this generate call (0 for the check after a prefill).

divide_method "step_length": due when cache_len > budget and either step is a multiple of
  divide_length or cache_len >= budget + divide_length (the cap). The step is the
  batch's, not the sequence's, as in R-KV's reference code and the paper's: every
  sequence past its budget is compressed at the same steps, in one batched compaction,
  rather than a few sequences at nearly every step (each event's launches cost the same
  for 3 sequences as for 30). A sequence compressed at a multiple of divide_length
  reaches the cap exactly at the next one, so the cache never exceeds budget +
  divide_length after a check; a prompt longer than the budget is compressed after its
  prefill, before its first decode step (the engine holds it whole while its samples
  copy it).
divide_method "newline": due when cache_len > budget and the token just generated
  decodes to text containing a newline, or when cache_len >= budget + max_buffer (the
  hard cap; max_buffer None means 4 * divide_length).
algorithm "none": never due.
keep_prompt: the prompt is never evicted and the budget counts response tokens only, so
  the engine passes cache_len without the prompt (evictable_len): every rule above then
  holds for the response part, and a cache holds prompt + budget entries after a
  compression.
The settings come from a CompressConfig, checked where it is loaded (validate_config).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from minisparse.config.schema import CompressConfig, Config, ConfigError


def max_buffer(cfg: CompressConfig) -> int:
    """The newline trigger's hard cap above the budget (None -> 4 * divide_length)."""
    return 4 * cfg.divide_length if cfg.max_buffer is None else cfg.max_buffer


def evictable_len(cfg: CompressConfig, cache_len: int, prompt_len: int) -> int:
    """The cache entries of a sequence that compression may evict, which the trigger and
    the budget count: all of them, or those past the prompt under keep_prompt."""
    return cache_len - prompt_len if cfg.keep_prompt else cache_len


def max_cache_tokens(cfg: CompressConfig, prompt_len: int | None = None) -> int | None:
    """Most tokens a sequence's cache holds after a decode step's compression check
    (before the compression that check triggers). None: unbounded (no compression, or
    keep_prompt without a prompt_len, whose bound grows with the prompt).
    A prompt longer than this exceeds it only between its prefill and the first check.
    """
    if cfg.algorithm == "none" or (cfg.keep_prompt and prompt_len is None):
        return None
    kept = cfg.budget + (prompt_len if cfg.keep_prompt else 0)
    if cfg.divide_method == "step_length":
        return kept + cfg.divide_length
    return kept + max_buffer(cfg)


def first_compression_len(cfg: CompressConfig, prompt_len: int) -> int | None:
    """The shortest response (in tokens) during which a sequence with a prompt of
    prompt_len tokens, decoded from the generate call's first step, is compressed; None
    when compression is off. The trigger is checked after the prefill (step 0) and after
    each decode step s whose sampled token does not end the sequence, i.e. with s
    generated tokens cached for a response of at least s + 2 tokens; the first check that
    is due has s past the budget and, for step_length, s a multiple of divide_length
    (newline: at the first newline). Under keep_prompt the prompt counts for nothing."""
    if cfg.algorithm == "none":
        return None
    prompt_len = evictable_len(cfg, prompt_len, prompt_len)
    first = max(0, cfg.budget + 1 - prompt_len)
    if cfg.divide_method == "step_length":
        first = -(-first // cfg.divide_length) * cfg.divide_length
    return first + 2


def unreachable(cfg: CompressConfig, prompt_len: int, response_len: int,
                spell: Callable[[str], str] = str) -> str | None:
    """Why compression can never run for a prompt of prompt_len tokens and responses of at
    most response_len (None when it can): said before a run that would be dense in all but
    name. `spell` renders a config key as the caller names it (a flag in the bench)."""
    need = first_compression_len(cfg, prompt_len)
    if need is None or need <= response_len:
        return None
    budget = spell("compress.budget")
    if cfg.divide_method == "step_length":
        divide = spell("compress.divide_length")
        trigger, fix = f"{divide} {cfg.divide_length}", f"{budget} or {divide}"
    else:
        trigger, fix = "the newline trigger", budget
    return (f"compression never runs: with {budget} {cfg.budget} and {trigger}, a "
            f"{prompt_len}-token prompt is first compressed in a response of {need} tokens, "
            f"longer than the {response_len} allowed; lower {fix}, or raise "
            f"{spell('max_response_len')}")


def check_compression_reach(cfg: Config) -> None:
    """ConfigError when a run's compression can never run: not even for the longest prompt
    it accepts (data.max_prompt_len) and its longest responses (max_response_len)."""
    problem = unreachable(cfg.compress, cfg.data.max_prompt_len, cfg.max_response_len)
    if problem:
        raise ConfigError(f"{problem} (data.max_prompt_len {cfg.data.max_prompt_len} "
                          f"is the longest prompt a run accepts)")


def compress_due(
    cache_len: torch.Tensor,
    step: int,
    last_token_is_newline: torch.Tensor,
    cfg: CompressConfig,
) -> torch.Tensor:
    """BoolTensor, True for the sequences to compress now (see the module docstring).

    cache_len and last_token_is_newline (bool; see newline_token_ids for building it with
    one lookup) have one entry per sequence; step is the batch's decode step count (0 after
    a prefill). The result is on their device.
    """
    if cfg.algorithm == "none":
        return torch.zeros_like(cache_len, dtype=torch.bool)
    over = cache_len > cfg.budget
    if cfg.divide_method == "step_length":
        capped = cache_len >= cfg.budget + cfg.divide_length
        return over & (capped | (step % cfg.divide_length == 0))
    capped = cache_len >= cfg.budget + max_buffer(cfg)
    return over & (last_token_is_newline.to(torch.bool) | capped)


def newline_token_ids(tokenizer) -> list[int]:
    """Sorted ids of the vocabulary's tokens whose decoded text contains a newline.

    Decodes every id (so byte-level BPE tokens such as "Ċ" count by their text, not by
    their spelling); special tokens are skipped because they are not text. Build a lookup
    once, e.g. `table = torch.zeros(vocab, dtype=bool); table[ids] = True`, then
    `last_token_is_newline = table[next_tokens]`.
    """
    vocab_size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = [i for i in range(vocab_size) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    return [i for i, text in zip(ids, texts) if "\n" in text]

