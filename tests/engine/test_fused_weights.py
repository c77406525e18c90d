"""The rollout-time fused qkv / gate-up copy of CausalLM: same forward as the module's own
weights, greedy tokens still equal transformers', made at bind (update_weights) and wake,
dropped at sleep, and its size reported."""
from __future__ import annotations

import torch

from engine_helpers import build, hf_greedy, make_engine, prompts
from minisparse.engine import SamplingParams
from minisparse.engine.models import CausalLM

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


def _fuse(engine) -> None:
    """The engine fuses on CUDA only; the CPU tests switch it on by hand."""
    engine.lm.fuse = True
    engine.lm.fuse_weights()


def test_fused_bytes_count_the_copies(model):
    lm = CausalLM(model, fuse=True)
    want = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for mod in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            want += mod.weight.numel() * 4
        want += sum(b.numel() * 4 for b in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
                    if b is not None)
    assert lm.fused_bytes == want > 0
    lm.release_fused()
    assert lm.fused_bytes == 0 and CausalLM(model).fused is None


def test_fused_greedy_matches_hf_and_unfused(model):
    ps = prompts(3, lo=4, hi=20)
    engine = make_engine(model)
    plain = engine.generate(ps, GREEDY)
    _fuse(engine)
    fused = engine.generate(ps, GREEDY)
    assert [o.token_ids for o in fused] == [hf_greedy(model, p, 16) for p in ps]
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_fused_copy_follows_update_weights_and_sleep(qwen2):
    engine = make_engine(qwen2)
    _fuse(engine)
    other = build("qwen2")
    with torch.no_grad():
        for w in other.parameters():
            w.mul_(1.5)
    engine.update_weights(other)  # rebuilt from the new module
    p = prompts(2)
    assert [o.token_ids for o in engine.generate(p, GREEDY)] == [hf_greedy(other, x, 16) for x in p]
    engine.sleep()
    assert engine.lm.fused is None and engine.lm.fused_bytes == 0
    engine.wake()
    assert engine.lm.fused_bytes > 0
    assert [o.token_ids for o in engine.generate(p, GREEDY)] == [hf_greedy(other, x, 16) for x in p]
