"""Dense (uncompressed) generation against transformers' own generate and forward."""
from __future__ import annotations

import pytest
import torch

from minisparse.engine import SamplingParams

from engine_helpers import EOS, dense_logprobs, hf_greedy, make_engine, prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


def test_greedy_matches_hf_generate(model):
    ps = prompts(5)
    engine = make_engine(model)
    outs = engine.generate(ps, GREEDY)
    assert len(outs) == len(ps)
    for p, o in zip(ps, outs):
        assert o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(model, p, GREEDY.max_new_tokens)
        assert o.finish_reason == "length"
        ref = dense_logprobs(model, p, o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)
    assert engine.last_stats.generated_tokens == 5 * 24
    assert engine.allocator.num_free == engine.pool.num_pages


def test_chunked_prefill_and_small_pages_give_same_tokens(qwen2):
    ps = prompts(6, lo=20, hi=60)
    base = make_engine(qwen2).generate(ps, GREEDY)
    chunked = make_engine(qwen2, max_prefill_tokens=17, page_size=4, max_num_seqs=3)
    outs = chunked.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    for a, b in zip(outs, base):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_stop_on_eos_and_stop_tokens(qwen2):
    engine = make_engine(qwen2)
    p = prompts(1)[0]
    free = engine.generate([p], GREEDY)[0].token_ids
    k = free.index(free[len(free) // 2])  # first occurrence of a mid-sequence token
    stop = engine.generate([p], SamplingParams(temperature=0, max_new_tokens=24,
                                               stop_token_ids=(free[k],)))[0]
    assert stop.token_ids == free[: k + 1] and stop.finish_reason == "stop"
    engine.eos_ids = {free[k]}
    eos = engine.generate([p], SamplingParams(temperature=0, max_new_tokens=24))[0]
    assert eos.token_ids == free[: k + 1] and eos.finish_reason == "stop"
    ignored = engine.generate([p], GREEDY)[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"
    assert EOS not in engine.eos_ids


def test_n_samples_are_prompt_major(qwen2):
    ps = prompts(3)
    outs = make_engine(qwen2).generate(ps, SamplingParams(n=4, max_new_tokens=5, seed=1))
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, j) for i in range(3)
                                                               for j in range(4)]
    assert all(o.prompt_token_ids == ps[o.prompt_index] for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 3  # samples differ


def test_too_long_prompt_aborts(qwen2):
    engine = make_engine(qwen2, max_model_len=32)
    outs = engine.generate([[5] * 40, [6] * 8], SamplingParams(temperature=0, max_new_tokens=50))
    assert outs[0].finish_reason == "abort" and outs[0].token_ids == []
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 32 - 8


def test_sleep_wake_and_update_weights(qwen2):
    from engine_helpers import build

    engine = make_engine(qwen2)
    p = prompts(2)
    before = engine.generate(p, GREEDY)
    engine.sleep()
    assert not engine.pool.allocated
    with pytest.raises(RuntimeError):
        engine.generate(p, GREEDY)
    engine.wake()
    other = build("qwen2")
    with torch.no_grad():
        for w in other.parameters():
            w.mul_(1.5)
    engine.update_weights(other)
    after = engine.generate(p, GREEDY)
    assert [o.token_ids for o in after] == [hf_greedy(other, x, 24) for x in p]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]


def test_engine_from_config_sections_and_backend_protocol(qwen2):
    from minisparse.config.schema import Config
    from minisparse.engine import LLMEngine, RolloutBackend, make_backend

    cfg = Config()
    cfg.engine.page_size, cfg.engine.max_num_seqs, cfg.engine.kv_cpu_memory_gb = 8, 4, 0.01
    cfg.compress.algorithm = "snapkv"
    engine = make_backend(cfg, qwen2, None, "cpu")
    args = engine.cfg
    assert (args.page_size, args.max_num_seqs, engine.compress.algorithm) == (8, 4, "snapkv")
    assert type(engine) is LLMEngine
    assert isinstance(engine, RolloutBackend)
    expected = int(0.01 * 2**30 * cfg.engine.kv_memory_fraction) // engine.pool.bytes_per_page()
    assert engine.pool.num_pages == expected - 1  # one scratch page
    outs = engine.generate(prompts(6), SamplingParams(max_new_tokens=4, seed=0))
    assert len(outs) == 6 and engine.rule is not None


def test_end_of_turn_ends_a_sample_even_when_eos_is_end_of_text(tiny_path):
    """A Qwen base checkpoint's eos is <|endoftext|> alone, but its RL prompts are in the
    chat format: <|im_end|> must still end the sample (training and eval alike)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisparse.engine.engine import eos_token_ids

    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tok.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = tok.eos_token_id
    ids = eos_token_ids(model, tok)
    assert ids == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
