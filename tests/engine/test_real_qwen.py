"""The engine against transformers on a real model, on a CPU: Qwen2.5-Coder-0.5B-Instruct
(see real_qwen for where it is found), dense and greedy, on MATH500 prompts (skipped
without the model or without the shared MATH500 file).

Where the two differ, only a near-tie may be the cause: the first differing step must
be one where transformers' own two best logits are within NEAR_TIE, the engine's token
one of the two (float32 here, so a tie is rare).
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from real_qwen import engine, load_qwen, math_prompts, needs_math500, needs_model

pytestmark = needs_model
PROMPTS, NEW, NEAR_TIE = 32, 64, 1e-3


@pytest.fixture(scope="module")
def qwen():
    return load_qwen()


@torch.no_grad()
def hf_batch_greedy(model, tok, prompts: list[list[int]], new: int) -> list[list[int]]:
    """One left-padded transformers generate, run to `new` tokens past any end of turn
    (no eos), as the engine runs with ignore_eos."""
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                         eos_token_id=None, pad_token_id=pad)
    return out[:, width:].tolist()


@torch.no_grad()
def top2(model, ids: list[int]):
    """transformers' two best next tokens after `ids`, and their logits."""
    return model(torch.tensor([ids])).logits[0, -1].float().topk(2)


@needs_math500
def test_engine_greedy_equals_transformers_on_math_prompts(qwen):
    from minisparse.engine import SamplingParams
    from minisparse.data.prompts import prompt_token_ids

    model, tok = qwen
    prompts = math_prompts(tok, PROMPTS)
    start = time.monotonic()
    outs = engine(model, tok, PROMPTS).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    engine_s = time.monotonic() - start
    ref = hf_batch_greedy(model, tok, prompts, NEW)
    transformers_s = time.monotonic() - start - engine_s
    identical, first_diff = 0, []
    for prompt, out, theirs in zip(prompts, outs, ref):
        ours = out.token_ids
        assert len(ours) == NEW
        n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if n is None:
            identical += 1
            continue
        first_diff.append(n)
        best = top2(model, prompt + theirs[:n])  # the same prefix on both sides
        assert best.values[0] - best.values[1] <= NEAR_TIE, (n, best)  # not a bug
        assert {ours[n], theirs[n]} == set(best.indices.tolist())
    print(json.dumps({"prompts": PROMPTS, "prompt_tokens": sum(map(len, prompts)),
                      "new_tokens": NEW, "identical": identical,
                      "first_difference_at": first_diff, "engine_s": round(engine_s, 1),
                      "transformers_s": round(transformers_s, 1)}))


def test_the_model_adds_25_and_17(qwen):
    """The download is the real model: greedy, it answers a sum in the eval prompt."""
    from minisparse.data.reward import grade
    from minisparse.engine import SamplingParams
    from minisparse.data.prompts import prompt_token_ids

    model, tok = qwen
    prompt = prompt_token_ids(tok, "What is 25 + 17?", "chat")
    sampler = engine(model, tok, 1)
    [out] = sampler.generate([prompt], SamplingParams(temperature=0, max_new_tokens=256))
    response = tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.token_ids[-1] in sampler.eos_ids, response  # it ended its answer
    assert grade(response, "42").score == 1.0, response
