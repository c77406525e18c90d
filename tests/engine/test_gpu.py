"""GPU checks in bf16 (skipped without CUDA): `python -m pytest tests/engine/test_gpu.py -q`.

Models: the tiny Qwen2 from minisparse.models.tiny, a 4-layer copy of the qwen2.5-3b shape (real
widths, head_dim 128, GQA 16/2) and the tiny llama3-rope Llama. In bf16, near-tied logits
make exact token equality with transformers fragile, so tokens are checked against a
teacher-forced transformers forward instead: each log-prob within bf16 tolerance, and each
greedy token (near-)argmax of the reference distribution.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from engine_helpers import build, dense_logprobs, make_engine, prompts, track
from minisparse.compression import max_cache_tokens
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams
from minisparse.engine.layers.sampler import truncate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16 = torch.bfloat16
LP_MEAN, LP_MAX, ARGMAX_SLACK = 0.03, 0.3, 0.1


def three_b_4_layers() -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    from minisparse.models.loading import shape_config

    cfg = shape_config("qwen2.5-3b", num_hidden_layers=4)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(BF16).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny() -> torch.nn.Module:
    from minisparse.models.loading import load_policy

    model, _ = load_policy("tiny", "bfloat16", "cuda")
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module", params=["tiny", "qwen2.5-3b-4l", "llama"])
def gpu_model(request):
    if request.param == "tiny":
        return tiny()
    if request.param == "llama":
        return build("llama", BF16, "cuda")
    return three_b_4_layers()


def vocab_prompts(model, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    vocab = model.config.vocab_size
    return [[4 + t % (vocab - 8) for t in p] for p in prompts(n, lo, hi, seed)]


def check_against_forward(model, prompt, out, temperature: float = 1.0, greedy: bool = False,
                          top_k: int = -1, top_p: float = 1.0):
    """The engine's log-probs against one HF forward's, renormalised over the top-k / top-p
    set when they truncate (the distribution the engine sampled from)."""
    rows = dense_logprobs(model, prompt, out.token_ids, temperature, full=True)
    if 0 < top_k < rows.shape[-1] or top_p < 1.0:
        # the kept set of this forward's logits, plus the token the engine drew: at the
        # nucleus' edge bf16 logits of the two computations can keep different tail tokens
        kept = truncate(rows.float(), top_k, top_p) > -float("inf")
        ids = torch.tensor(out.token_ids, device=rows.device)
        kept[torch.arange(len(ids), device=rows.device), ids] = True
        rows = torch.log_softmax(rows.float().masked_fill(~kept, -float("inf")), -1)
    ids = torch.tensor(out.token_ids, device=rows.device)
    ref = rows.gather(-1, ids[:, None])[:, 0]
    err = (ref - torch.tensor(out.logprobs, device=rows.device)).abs()
    assert err.mean() < LP_MEAN and err.max() < LP_MAX, (err.mean(), err.max())
    if greedy:
        assert (rows.max(-1).values - ref).max() < ARGMAX_SLACK


def test_greedy_and_logprobs_match_transformers(gpu_model):
    engine = make_engine(gpu_model, kv_memory_gb=1.0)
    ps = vocab_prompts(gpu_model, 6, 5, 120)
    outs = engine.generate(ps, SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True))
    for p, o in zip(ps, outs):
        assert len(o.token_ids) == 48
        check_against_forward(gpu_model, p, o, greedy=True)
    assert engine.allocator.num_free == engine.pool.num_pages


def test_sampling_reproduces_and_logprobs_are_those_of_the_truncated_law(gpu_model):
    # In float32: the 3B shape's bf16 logits come in steps of 1/64 around the top-50's
    # (raw 3-4), so ties of 2-4 tokens sit at the top-k and nucleus cuts, and one step of
    # difference between two bf16 computations moves them: 5-14% of the kept mass
    # (0.05-0.14 in log-prob), a difference of the kept set, not of the law.
    model = copy.deepcopy(gpu_model).float()
    engine = make_engine(model, kv_memory_gb=1.0)
    ps = vocab_prompts(model, 3, 5, 60)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, n=2, max_new_tokens=32,
                            seed=3, ignore_eos=True)
    a, b = engine.generate(ps, params), engine.generate(ps, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for o in a:
        check_against_forward(model, ps[o.prompt_index], o, temperature=0.8, top_k=50,
                              top_p=0.9)
    top1 = engine.generate(ps, SamplingParams(temperature=0.8, top_k=1, max_new_tokens=16,
                                              seed=1, ignore_eos=True))
    for p, o in zip(ps, top1):  # the argmax, the one token kept: probability 1
        rows = dense_logprobs(model, p, o.token_ids, 0.8, full=True)
        ids = torch.tensor(o.token_ids, device=rows.device)
        assert (rows.max(-1).values - rows.gather(-1, ids[:, None])[:, 0]).max() < ARGMAX_SLACK
        assert max(abs(lp) for lp in o.logprobs) < 1e-5


def test_preemption_completes_every_sample(gpu_model):
    ps = vocab_prompts(gpu_model, 8, 20, 60)
    engine = make_engine(gpu_model, kv_memory_gb=1.0, page_size=16)
    pages = 24
    engine.cfg.kv_memory_gb = (pages + 1) * engine.pool.bytes_per_page() / 2**30
    engine.sleep()
    engine.wake()
    assert engine.pool.num_pages == pages
    outs = engine.generate(ps, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    assert engine.last_stats.preemptions > 0
    assert engine.allocator.num_free == pages
    for p, o in zip(ps, outs):
        assert o.finish_reason == "length" and len(o.token_ids) == 64
        check_against_forward(gpu_model, p, o, greedy=True)


@pytest.mark.parametrize("algorithm,keep_prompt", [
    ("knorm", False), ("rkv", False), ("snapkv", False), ("streaming_llm", False),
    ("rkv", True)])  # keep_prompt: the Triton packing after each sequence's own prompt
def test_compressed_attention_matches_kept_tokens(gpu_model, algorithm, keep_prompt,
                                                  monkeypatch):
    cfg = CompressConfig(algorithm=algorithm, budget=32, window=8, divide_length=16,
                         keep_prompt=keep_prompt)
    engine = make_engine(gpu_model, cfg, kv_memory_gb=1.0, page_size=16, cuda_graphs=False)
    tr = track(engine, monkeypatch)  # python checks in every attention call: no graphs
    ps = vocab_prompts(gpu_model, 4, 10, 70)
    outs = engine.generate(ps, SamplingParams(max_new_tokens=60, seed=0, ignore_eos=True))
    assert engine.last_stats.compressions > 0 and tr.checked > 0
    assert tr.max_err < 3e-2, tr.max_err
    for p, o in zip(ps, outs):
        assert o.peak_cache_tokens <= max(max_cache_tokens(cfg, len(p)), len(p))
    if keep_prompt:  # every head of every layer still holds its whole prompt, in order
        for (seq, _), heads in tr.entries.items():
            assert all(h[:len(ps[seq])] == list(range(len(ps[seq]))) for h in heads)
    assert engine.allocator.num_free == engine.pool.num_pages


def test_cuda_graphs_match_eager(gpu_model):
    ps = vocab_prompts(gpu_model, 5, 5, 80)  # 5 sequences: padded to the 8-bucket
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    graphs = make_engine(gpu_model, kv_memory_gb=1.0)
    outs = graphs.generate(ps, params)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs
    eager = make_engine(gpu_model, kv_memory_gb=1.0, cuda_graphs=False).generate(ps, params)
    for p, g, e in zip(ps, outs, eager):
        check_against_forward(gpu_model, p, g, greedy=True)
        n = next((i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), 40)
        err = (torch.tensor(g.logprobs[:n]) - torch.tensor(e.logprobs[:n])).abs()
        assert n == 0 or err.max() < LP_MAX / 3


@pytest.mark.parametrize("algorithm", ["none", "rkv", "knorm"])  # knorm: no query ring
def test_overlapped_steps_match_serial_steps(gpu_model, algorithm):
    """Same batches either way (no stop tokens): the same samples, bit for bit; and the
    results land in pinned, contiguous memory (else the copy would wait for the step)."""
    cfg = CompressConfig(algorithm=algorithm, budget=32, window=8, divide_length=16)
    ps = vocab_prompts(gpu_model, 6, 5, 80)
    params = SamplingParams(temperature=1.0, max_new_tokens=70, seed=5, ignore_eos=True)
    outs = {}
    for overlap in (True, False):
        engine = make_engine(gpu_model, cfg, kv_memory_gb=1.0, page_size=16,
                             overlap_decode=overlap)
        outs[overlap] = engine.generate(ps, params)
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("algorithm", ["none", "rkv"])
def test_samples_sharing_a_prompt_match_samples_that_prefill_it(algorithm):
    """In fp32 through the CUDA path (fused kernels, graphs, the page copy on the device):
    samples that took their prompt's pages (dense) or a copy of them (R-KV) from a sibling
    are the samples of an engine that prefills every one."""
    model = build("qwen2", torch.float32, "cuda")
    cfg = CompressConfig(algorithm=algorithm, budget=64, window=8, divide_length=16)
    ps = vocab_prompts(model, 4, 30, 70)  # under budget + 16: no compaction at a prefill
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=60, seed=4, ignore_eos=True)
    outs, shared = {}, {}
    for share in (True, False):
        engine = make_engine(model, cfg, kv_memory_gb=1.0, page_size=16,
                             share_prompt_cache=share)
        outs[share] = engine.generate(ps, params)
        shared[share] = engine.last_stats.shared_prompt_tokens
        assert engine.allocator.num_free == engine.pool.num_pages
    assert shared[True] > 0 == shared[False]
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_overlapped_steps_with_a_queue_and_stops(gpu_model):
    """More samples than slots and a stop token: the overlapped engine admits while it
    decodes ahead; every sample must still be what the model gives its own prefix."""
    ps = vocab_prompts(gpu_model, 10, 5, 60)
    stop = ps[0][-1]  # a token the prompts use, so some samples stop early
    engine = make_engine(gpu_model, kv_memory_gb=1.0, max_num_seqs=4)
    outs = engine.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=48, seed=2,
                                              stop_token_ids=[stop]))
    stops = {stop} | engine.eos_ids
    assert {o.finish_reason for o in outs} <= {"stop", "length"}
    for p, o in zip(ps, outs):
        assert (o.finish_reason == "stop") == (o.token_ids[-1] in stops)
        assert not stops & set(o.token_ids[:-1])
        check_against_forward(gpu_model, p, o)
    assert engine.allocator.num_free == engine.pool.num_pages


def test_decode_results_copy_to_pinned_contiguous_memory(gpu_model):
    engine = make_engine(gpu_model, kv_memory_gb=1.0)
    out = torch.zeros(2, 5, dtype=torch.float64, device="cuda")
    host = engine.runner._to_pinned(out)
    assert host.is_pinned() and host.is_contiguous() and host.shape == (2, 5)


def test_sleep_releases_pool_memory(gpu_model):
    engine = make_engine(gpu_model, kv_memory_gb=0.5)
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    engine.sleep()
    assert awake - torch.cuda.memory_allocated() >= 0.5 * 2**30 * 0.99
    engine.wake()
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4))
    assert len(out[0].token_ids) == 4


def test_fraction_sized_pool_and_bench(tmp_path):
    from minisparse.bench.run import parse_args, run

    path = tmp_path / "bench.json"
    result = run(parse_args(["--model", "tiny", "--device", "cuda", "--batch", "16",
                             "--prompt-len", "64", "--max-new-tokens", "128", "--compress", "rkv",
                             "--budget", "64", "--divide-length", "32",
                             "--kv-memory-fraction", "0.1",
                             "--json", str(path)]))
    saved = json.loads(path.read_text())
    for key in ("tokens_per_s", "generated_tokens", "wall_s", "peak_kv_tokens",
                "peak_kv_tokens_per_seq", "preemptions", "peak_gpu_memory_gb"):
        assert key in saved
    assert result["generated_tokens"] == 16 * 128
    assert result["peak_kv_tokens_per_seq"] <= 64 + 32
