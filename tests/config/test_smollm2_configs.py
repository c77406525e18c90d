"""The SmolLM2 ablation configs: the proportions configs/smollm2_rkv.yaml states, computed
here from the settings of it and its SnapKV twin (prompt tokens with the real tokenizer,
which is skipped where the model has not been downloaded)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from minisparse.compression import compress_due, max_cache_tokens
from minisparse.compression.trigger import first_compression_len
from minisparse.config.load import CONFIGS_DIR, load_config
from minisparse.data.synthetic import Difficulty, synthetic_problems

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "checkpoints" / "smollm2-135m-instruct"
COMPRESSED = ("smollm2_rkv", "smollm2_snapkv")
# Measured on the base model (docs/results.md, "Choosing the task and the design"): mean
# and p90 response tokens at the configs' difficulty and temperature.
RESPONSE_MEAN, RESPONSE_P90 = 142, 234
PROMPT = 56  # every prompt at this difficulty (checked below with the real tokenizer)


def test_held_out_evaluation_samples_as_the_rollouts_do():
    cfg = load_config("smollm2_dense")
    assert cfg.eval_interval > 0 and cfg.eval.benchmarks == ["arithmetic"]
    assert (cfg.eval.temperature, cfg.eval.top_p) == (cfg.temperature, cfg.top_p)
    assert cfg.eval.max_new_tokens == cfg.max_response_len and not cfg.eval.compress
    held_out = {q for q, _ in synthetic_problems(500, 1234, "heldout",
                                                 Difficulty.from_config(cfg.data))}
    assert len(held_out) >= 10


def _compressions(cfg, prompt: int, response: int) -> int:
    """Compressions of one sequence, by the trigger (checked after the prefill and after
    every decode step but the last)."""
    cache, count = prompt, 0
    for step in range(response - 1):
        cache += step > 0
        if bool(compress_due(torch.tensor([cache]), step, torch.tensor([False]), cfg)):
            count, cache = count + 1, cfg.budget
    return count


@pytest.mark.parametrize("name", COMPRESSED)
def test_compressed_configs_hold_the_stated_proportions(name):
    """Compression acts on every response token whatever the answer's length: the budget
    is below the prompt, so the cache is compressed right after the prefill (the looser
    first design stopped acting once answers shrank: docs/results.md)."""
    cfg = load_config(name)
    c, text = cfg.compress, (CONFIGS_DIR / "smollm2_rkv.yaml").read_text()
    assert c.window == 8 and not c.keep_prompt and c.divide_length == 8
    assert c.budget < PROMPT
    assert first_compression_len(c, PROMPT) == 2  # checked right after the prefill
    assert _compressions(c, PROMPT, 2) == 1  # a 2-token answer is already compressed
    peak, dense = max_cache_tokens(c), PROMPT + RESPONSE_MEAN
    assert f"{PROMPT} + {RESPONSE_MEAN} = {dense}" in text
    assert f"{c.budget} + {c.divide_length} = {peak} KV tokens, {peak / dense:.2f} of dense" \
        in text
    times = (_compressions(c, PROMPT, RESPONSE_MEAN), _compressions(c, PROMPT, RESPONSE_P90))
    assert f"compressed {times[0]} times in a response of\n# mean length ({times[1]} at p90)" \
        in text


@pytest.mark.skipif(not (MODEL / "tokenizer.json").is_file(),
                    reason="needs checkpoints/smollm2-135m-instruct")
def test_every_prompt_has_the_stated_length_with_the_real_tokenizer():
    from transformers import AutoTokenizer

    from minisparse.data.datasets import load_prompts
    from minisparse.data.prompts import prompt_token_ids

    tok = AutoTokenizer.from_pretrained(MODEL)
    cfg = load_config("smollm2_rkv")
    rows = load_prompts(dataclasses.replace(cfg.data, synthetic_size=300), tok)
    assert {len(r.prompt_ids) for r in rows} == {PROMPT}
    held_out = synthetic_problems(50, 1234, "heldout", Difficulty.from_config(cfg.data))
    assert {len(prompt_token_ids(tok, q, "user")) for q, _ in held_out} == {PROMPT}
    assert [r.prompt_ids for r in rows[:1]] == [prompt_token_ids(
        tok, rows[0].prompt_text.split("$")[1].join(["What is $", "$?"]), "user")]
