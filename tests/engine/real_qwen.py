"""The real Qwen2.5-Coder-0.5B-Instruct on a CPU, shared by the tests that run it: where
it is (python -m minisparse.download --model qwen2.5-coder-0.5b-instruct --out
checkpoints/, or MINISPARSE_QWEN05=DIR), the shared MATH500 file, and a native engine
over the model. Those tests skip without the model, or without the MATH500 file where
they need it.

Inference only: training this model on a CPU peaked at 23.4 GB of host memory.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("MINISPARSE_QWEN05",
                            REPO / "checkpoints" / "qwen2.5-coder-0.5b-instruct"))
MATH500 = REPO.parent / "shared" / "data" / "eval" / "math500" / "test.jsonl"
needs_model = pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                                 reason=f"no model at {MODEL}")
needs_math500 = pytest.mark.skipif(not MATH500.is_file(), reason=f"no {MATH500}")


def load_qwen():
    """(model, tokenizer) in float32, in eval mode."""
    from minisparse.models.loading import load_policy

    model, tok = load_policy(str(MODEL), "float32", "cpu")
    return model.eval(), tok


def engine(model, tok, seqs: int, compress=None):
    """A native CPU engine over the model for up to `seqs` sequences at once (compress: a
    CompressConfig, None for dense)."""
    from minisparse.config.schema import EngineConfig
    from minisparse.engine.engine import LLMEngine

    return LLMEngine(model, tok, EngineConfig(kv_cpu_memory_gb=0.5, max_num_seqs=seqs),
                     compress, device="cpu")


def math_prompts(tok, n: int) -> list[list[int]]:
    """The first n MATH500 problems as eval.py prompts them (chat template), token ids."""
    from minisparse.data.benchmarks import load_benchmark
    from minisparse.data.prompts import prompt_token_ids

    problems = load_benchmark("math500", MATH500.parents[1], limit=n)
    return [prompt_token_ids(tok, p.question, "chat") for p in problems]
