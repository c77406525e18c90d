"""The engine against transformers on a real checkpoint (SmolLM2-135M-Instruct, bf16, GPU):
greedy outputs of 16 held-out arithmetic prompts, 128 new tokens each (compared up to the
first end-of-turn token: transformers is kept from emitting one, the engine is not). Skipped without
CUDA or without the model (python -m minisparse.download --model smollm2-135m-instruct
--out checkpoints/; or MINISPARSE_SMOLLM2=DIR).

Where the two differ, bf16 near-ties are the only accepted cause: every engine token must
be (near-)argmax of a teacher-forced transformers forward, and the first differing step
must be a near-tie there.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine_helpers import greedy_matches_transformers

MODEL = Path(os.environ.get("MINISPARSE_SMOLLM2", "checkpoints/smollm2-135m-instruct"))
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason=f"no model at {MODEL}"),
]
# A trained model's logits reach |20|, where bf16 values are 0.125 apart (0.0625 in
# [8, 16)); two such steps are what kernel-order differences can move a near-tie by
# (an H200 run hit exactly 0.25, so the bound is inclusive).
# (0.1, the slack of the random-weight tests, failed here at 0.125 on the first prompt.)
NEW, PROMPTS, ARGMAX_SLACK = 128, 16, 0.25


def test_engine_greedy_equals_transformers_generate():
    from minisparse.data.benchmarks import load_benchmark
    from minisparse.config.schema import EngineConfig
    from minisparse.engine import SamplingParams
    from minisparse.engine.engine import LLMEngine
    from minisparse.data.prompts import prompt_token_ids
    from minisparse.models.loading import load_policy

    model, tok = load_policy(str(MODEL), "bfloat16", "cuda")
    model.eval()
    questions = [p.question for p in load_benchmark("arithmetic", "", limit=PROMPTS)]
    prompts = [prompt_token_ids(tok, q, "user") for q in questions]
    engine = LLMEngine(model, tok, EngineConfig(kv_memory_gb=1.0, max_num_seqs=PROMPTS),
                       device="cuda")
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW,
                                                   ignore_eos=True))
    same, first_diff = greedy_matches_transformers(model, engine, prompts, outs,
                                                   ARGMAX_SLACK)
    # On an H200 3 of 16 were identical: a 135M model's bf16 logits tie often (values
    # 0.125 apart near |20|), so the real check is the one above on every difference.
    print(json.dumps({"prompts": PROMPTS, "new_tokens": NEW, "identical": same,
                      "first_difference_at": first_diff}))
