"""The engine against transformers on a real Qwen model on a GPU, bf16: the twin of
test_real_qwen.py (float32, CPU) for the size a CPU cannot take in a test, the 1.5B
(MINISPARSE_QWEN=DIR, default checkpoints/qwen2.5-coder-1.5b-instruct; python -m
minisparse.download --model qwen2.5-coder-1.5b-instruct --out checkpoints/). Greedy tokens
of the first 32 MATH500 prompts (eval.py's chat prompt), 64 new tokens each.

In bf16 two kernels may order a sum differently and turn a near-tie the other way, so
every engine token must be a (near-)argmax of a teacher-forced transformers forward, and
the first step where the two differ must be a near-tie there (ARGMAX_SLACK: two bf16
steps of a logit near |20|, as in test_gpu_real_model.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine_helpers import greedy_matches_transformers

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("MINISPARSE_QWEN",
                            REPO / "checkpoints" / "qwen2.5-coder-1.5b-instruct"))
MATH500 = Path(os.environ.get("MINISPARSE_MATH500",
                              REPO.parent / "shared" / "data" / "eval" / "math500" / "test.jsonl"))
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason=f"no model at {MODEL}"),
    pytest.mark.skipif(not MATH500.is_file(), reason=f"no {MATH500}"),
]
PROMPTS, NEW, ARGMAX_SLACK = 32, 64, 0.25


def test_engine_greedy_equals_transformers_on_math_prompts():
    from minisparse.config.schema import EngineConfig
    from minisparse.data.benchmarks import load_benchmark
    from minisparse.engine import SamplingParams
    from minisparse.engine.engine import LLMEngine
    from minisparse.data.prompts import prompt_token_ids
    from minisparse.models.loading import load_policy

    model, tok = load_policy(str(MODEL), "bfloat16", "cuda")
    model.eval()
    problems = load_benchmark("math500", MATH500.parents[1], limit=PROMPTS)
    prompts = [prompt_token_ids(tok, p.question, "chat") for p in problems]
    engine = LLMEngine(model, tok, EngineConfig(kv_memory_gb=2.0, max_num_seqs=PROMPTS),
                       device="cuda")
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW,
                                                   ignore_eos=True))
    same, first_diff = greedy_matches_transformers(model, engine, prompts, outs,
                                                   ARGMAX_SLACK)
    print(json.dumps({"model": MODEL.name, "prompts": PROMPTS, "new_tokens": NEW,
                      "identical": same, "first_difference_at": first_diff}))
