"""The SGLang backend on a real sglang.Engine (skipped without CUDA or SGLang):
`python -m pytest tests/engine/test_gpu_sglang.py -q` on a GPU machine with SGLang 0.5.16.

One engine for the module (start-up is the slow part): the 4-layer qwen2.5-3b-shaped model,
whose weights reach SGLang only through update_weights (it starts on dummy weights).
"""
from __future__ import annotations

import pytest
import torch

from engine_helpers import dense_logprobs, prompts
from minisparse.config.schema import EngineConfig
from minisparse.engine import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("sglang")
LP_MEAN, LP_MAX = 0.05, 0.5  # bf16 noise between SGLang's kernels and transformers


@pytest.fixture(scope="module")
def setup():
    from test_gpu import three_b_4_layers

    from minisparse.engine.sglang_backend import SGLangBackend

    model = three_b_4_layers()
    backend = SGLangBackend(model, None, EngineConfig(kv_memory_fraction=0.3, max_num_seqs=64),
                            None, "cuda:0", "bfloat16", seed=0)
    backend.update_weights(model)
    yield model, backend
    backend.shutdown()


def _check_logprobs(model, outs) -> None:
    errs = torch.cat([(dense_logprobs(model, o.prompt_token_ids, o.token_ids)
                       - torch.tensor(o.logprobs, device="cuda")).abs() for o in outs])
    assert errs.mean() < LP_MEAN and errs.max() < LP_MAX, (errs.mean(), errs.max())


@torch.no_grad()
def test_sampled_logprobs_match_the_dense_policy(setup):
    model, backend = setup
    ps = [[4 + t for t in p] for p in prompts(4, 5, 30)]
    outs = backend.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=24, n=2,
                                               seed=3, ignore_eos=True))
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(p, j) for p in range(4)
                                                                for j in range(2)]
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    _check_logprobs(model, outs)


@torch.no_grad()
def test_sleep_wake_and_new_weights_change_the_samples(setup):
    model, backend = setup
    ps = [[4 + t for t in p] for p in prompts(2, 5, 20, seed=1)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    before = backend.generate(ps, greedy)
    backend.sleep()
    backend.wake()
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # tied: the embedding flips too
    try:
        backend.update_weights(model)
        after = backend.generate(ps, greedy)
        assert [o.token_ids for o in after] != [o.token_ids for o in before]
        _check_logprobs(model, after)
    finally:
        model.lm_head.weight.mul_(-1.0)
        backend.update_weights(model)
