"""Triggers: simulated generation checks the cache bound and the batch-wide schedule;
newline_token_ids on tokenizers built in-process (the settings' checks: tests/config)."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from minisparse.compression import compress_due, max_cache_tokens, newline_token_ids
from minisparse.config.schema import CompressConfig


def simulate(cfg: CompressConfig, prompt_lens: torch.Tensor, steps: int,
             newline_rate: float = 0.0, seed: int = 0):
    """Generate up to `steps` tokens for every sequence (sequence b starts b steps late, so
    the sequences pass their budget at different steps), compressing whenever
    compress_due says so, as the engine would.

    Returns the peak cache length seen at any check and, per sequence, the list of
    (step, cache_len, was_newline) at each compression after prefill.
    """
    gen = torch.Generator().manual_seed(seed)
    cache = prompt_lens.clone()
    no_newline = torch.zeros_like(cache, dtype=torch.bool)
    fired = compress_due(cache, 0, no_newline, cfg)  # the check after prefill
    cache[fired] = cfg.budget
    peak = int(cache.max())
    events: list[list[tuple[int, int, bool]]] = [[] for _ in range(len(cache))]
    for step in range(1, steps + 1):
        active = torch.arange(len(cache)) < step
        cache += active.long()
        newline = active & (torch.rand(len(cache), generator=gen) < newline_rate)
        fired = compress_due(cache, step, newline, cfg)
        assert not (fired & ~active).any(), "an idle sequence was compressed"
        peak = max(peak, int(cache.max()))
        for b in fired.nonzero().flatten().tolist():
            events[b].append((step, int(cache[b]), bool(newline[b])))
        cache[fired] = cfg.budget
    return peak, events


PROMPTS = torch.tensor([5, 100, 127, 128, 129, 150, 200, 250, 30, 64])


@pytest.mark.parametrize("divide_length", [1, 7, 32])
def test_step_length_bound_and_schedule(divide_length):
    cfg = CompressConfig(algorithm="rkv", budget=128, divide_length=divide_length)
    peak, events = simulate(cfg, PROMPTS, steps=400)
    bound = max_cache_tokens(cfg)
    assert bound == 128 + divide_length
    assert peak <= max(bound, int(PROMPTS.max()))  # long prompts: only at prefill
    for b, seq_events in enumerate(events):
        assert seq_events, f"sequence {b} was never compressed"
        steps = [step for step, _, _ in seq_events]
        for _, cache, _ in seq_events:
            assert 128 < cache <= bound
        # Every sequence at the batch's multiples of divide_length (one batched compaction
        # each), so once compressed to the budget, every divide_length tokens exactly.
        assert all(step % divide_length == 0 for step in steps)
        assert all(b - a == divide_length for a, b in zip(steps, steps[1:]))


def test_step_length_long_prompt_compressed_at_prefill():
    cfg = CompressConfig(algorithm="rkv", budget=128, divide_length=16)
    cache = torch.tensor([500, 144, 143, 128])
    no_newline = torch.zeros_like(cache, dtype=torch.bool)
    assert compress_due(cache, 0, no_newline, cfg).tolist() == [True, True, True, False]
    # between the batch's compression steps only the cap (budget + divide_length) is due
    assert compress_due(cache, 5, no_newline, cfg).tolist() == [True, True, False, False]


@pytest.mark.parametrize("rate", [0.0, 0.05, 0.5])
def test_newline_bound(rate):
    cfg = CompressConfig(algorithm="snapkv", budget=128, divide_method="newline",
                         divide_length=16)
    peak, events = simulate(cfg, PROMPTS, steps=400, newline_rate=rate)
    assert max_cache_tokens(cfg) == 128 + 64
    assert peak <= max(128 + 64, int(PROMPTS.max()))
    for seq_events in events:
        assert seq_events
        for _, cache, newline in seq_events:
            assert cache > 128 and (newline or cache == 128 + 64)
    if rate == 0.5:  # newlines arrive long before the cap
        assert all(cache < 128 + 64 for seq in events for _, cache, _ in seq[1:])


def test_newline_explicit_max_buffer():
    cfg = CompressConfig(algorithm="rkv", budget=100, divide_method="newline", max_buffer=10)
    cache = torch.tensor([100, 101, 109, 110, 100])
    newline = torch.tensor([True, True, False, False, True])
    assert compress_due(cache, 3, newline, cfg).tolist() == [
        False, True, False, True, False]
    assert max_cache_tokens(cfg) == 110


@pytest.mark.parametrize("cfg", [CompressConfig(algorithm="none")])
def test_never(cfg):
    cache = torch.tensor([10_000, 600])
    due = compress_due(cache, 0, torch.tensor([True, True]), cfg)
    assert due.tolist() == [False, False] and max_cache_tokens(cfg) is None


def _wrap(vocab: dict[str, int], byte_level: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if byte_level:
        tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<eos>")


def test_newline_ids_plain_vocab():
    vocab = {"<unk>": 0, "<eos>": 1, "a": 2, "\n": 3, "b\n": 4, "\n\n": 5, "c": 6, "n": 7}
    assert newline_token_ids(_wrap(vocab, byte_level=False)) == [3, 4, 5]


def test_newline_ids_byte_level_vocab():
    """GPT-2 style vocabularies spell "\\n" as "Ċ": found by decoding, not spelling."""
    vocab = {"<unk>": 0, "<eos>": 1, "Ċ": 2, "ĠĊ": 3, "x": 4, "ĊĊ": 5, "Ġx": 6, "\\n": 7}
    assert newline_token_ids(_wrap(vocab, byte_level=True)) == [2, 3, 5]


def test_unreachable_compression_is_named_with_its_fix():
    from minisparse.compression.trigger import first_compression_len, unreachable

    cfg = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=128)
    assert first_compression_len(cfg, 16) == 130  # exact: tests/engine/test_compression.py
    assert first_compression_len(CompressConfig(), 16) is None  # dense
    assert unreachable(cfg, 16, 130) is None
    text = unreachable(cfg, 16, 64, spell=lambda key: "--" + key.split(".")[-1])
    assert text == ("compression never runs: with --budget 16 and --divide_length 128, a "
                    "16-token prompt is first compressed in a response of 130 tokens, longer "
                    "than the 64 allowed; lower --budget or --divide_length, or raise "
                    "--max_response_len")
    newline = CompressConfig(algorithm="snapkv", budget=64, window=4, divide_method="newline")
    assert first_compression_len(newline, 16) == 51  # at the first newline past the budget
    assert "lower compress.budget, or" in unreachable(newline, 16, 50)


def test_training_config_whose_compression_never_runs_is_refused():
    from minisparse.compression.trigger import check_compression_reach
    from minisparse.config.load import load_config
    from minisparse.config.schema import ConfigError

    check_compression_reach(load_config("smollm2_rkv"))
    with pytest.raises(ConfigError, match="compression never runs: .* a 128-token prompt "
                                          "is first compressed in a response of 578 tokens"):
        check_compression_reach(load_config("smollm2_rkv", ["compress.budget=700"]))
    check_compression_reach(load_config("smollm2_dense", ["compress.budget=700"]))  # dense


def test_keep_prompt_counts_the_response_only():
    """Under keep_prompt the prompt counts for nothing: a 60-token prompt is first
    compressed 24 tokens into the response (the first multiple of 8 past the budget of
    16), not right after it is read; the cache bound grows by the prompt."""
    from minisparse.compression import evictable_len
    from minisparse.compression.trigger import first_compression_len

    off = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8)
    on = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8,
                        keep_prompt=True)
    assert first_compression_len(off, 60) == 2  # compressed once read, seen at 2 tokens
    assert first_compression_len(on, 60) == 24 + 2
    assert first_compression_len(on, 5) == first_compression_len(on, 60)
    assert max_cache_tokens(off) == max_cache_tokens(off, 60) == 24
    assert max_cache_tokens(on) is None and max_cache_tokens(on, 60) == 84
    assert (evictable_len(off, 70, 60), evictable_len(on, 70, 60)) == (70, 10)
