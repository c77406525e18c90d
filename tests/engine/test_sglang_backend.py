"""The SGLang backend on a CPU: config rules, the factory, and the adapter's requests,
output parsing, seeds, ordering, phase control and weight export, against the fake
sglang package of fake_sglang.py (the real engine is exercised by test_gpu_sglang.py)."""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

import fake_sglang
from minisparse.config.schema import ConfigError
from minisparse.config.load import load_config
from minisparse.config.schema import EngineConfig
from minisparse.engine import (LLMEngine, RolloutBackend, SamplingParams, check_backend,
                               make_backend)
from minisparse.bench import run as bench
from minisparse.engine.engine import eos_token_ids
from minisparse.engine.layers.sampler import seed_for
from minisparse.engine.sglang_backend import (
    SGLangBackend, attention_backend, kv_bytes_per_token, memory_fraction, parse_output, request_params,
    weight_buckets,
)
from minisparse.models.loading import load_policy, shape_config

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_policy(str(tiny_path), "float32", "cpu")


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 * GIB, 96 * GIB))
    return fake_sglang.install(monkeypatch)


def _backend(tiny, **kw) -> SGLangBackend:
    model, tok = tiny
    return SGLangBackend(model, tok, EngineConfig(**kw), None, "cuda:1", "float32", seed=5)


# ---- config and factory -------------------------------------------------------------------

def test_sglang_with_compression_fails_at_config_time_saying_why():
    with pytest.raises(ConfigError, match="cannot free evicted tokens"):
        load_config("tiny_rkv", ["engine.backend=sglang"])
    assert load_config("tiny_dense", ["engine.backend=sglang"]).engine.backend == "sglang"
    with pytest.raises(ConfigError, match="engine.backend"):
        load_config("tiny_dense", ["engine.backend=vllm"])


def test_eval_cli_refuses_sglang_with_compression(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
    eval_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_cli)
    code = eval_cli.main(["--model", "tiny", "--backend", "sglang", "--compress", "rkv",
                          "--output", str(tmp_path / "r")])
    assert code == 2 and "cannot free evicted tokens" in capsys.readouterr().err


def test_make_backend_native_is_the_llm_engine(tiny):
    model, tok = tiny
    backend = make_backend(load_config("tiny_dense"), model, tok, "cpu")
    assert isinstance(backend, LLMEngine) and isinstance(backend, RolloutBackend)


def test_make_backend_sglang_starts_on_dummy_weights_then_pushes_the_policy(tiny, fake):
    model, tok = tiny
    cfg = load_config("tiny_dense", ["engine.backend=sglang", "seed=11"])
    backend = make_backend(cfg, model, tok, "cuda:0")
    assert isinstance(backend, SGLangBackend) and isinstance(backend, RolloutBackend)
    engine = fake.instances[0]
    assert engine.kwargs["load_format"] == "dummy" and engine.kwargs["random_seed"] == 11
    assert set(engine.weights) == {n for n, _ in model.named_parameters()}


def test_engine_starts_without_the_torchrun_environment_which_comes_back_after(tiny, fake,
                                                                              monkeypatch):
    launcher = {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "0", "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for k, v in launcher.items():
        monkeypatch.setenv(k, v)
    _backend(tiny)
    assert not set(launcher) & set(fake.instances[0].environ)
    assert {k: os.environ[k] for k in launcher} == launcher


# ---- engine arguments -----------------------------------------------------------------------

def test_engine_kwargs_colocate_on_this_gpu_with_ids_only_io(tiny, fake):
    backend = _backend(tiny, max_num_seqs=7, max_prefill_tokens=999, cuda_graphs=False)
    kw = fake.instances[0].kwargs
    assert kw["base_gpu_id"] == 1 and kw["tp_size"] == 1 and kw["random_seed"] == 5
    assert kw["skip_tokenizer_init"] and kw["enable_memory_saver"]
    assert kw["max_running_requests"] == 7 and kw["max_prefill_tokens"] == 999
    assert kw["disable_cuda_graph"]
    assert kw["max_total_tokens"] == 7 * tiny[0].config.max_position_embeddings
    assert kw["attention_backend"] == "triton"  # the tiny model's 16-wide heads
    assert attention_backend(shape_config("qwen2.5-3b")) == "fa3"
    config = AutoConfig.from_pretrained(kw["model_path"])
    assert config.architectures == [type(tiny[0]).__name__]
    assert config.num_hidden_layers == tiny[0].config.num_hidden_layers
    assert backend.eos_ids == eos_token_ids(*tiny)


def test_the_config_dir_goes_at_shutdown_and_when_the_backend_is_dropped(tiny, fake, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    backend = _backend(tiny)
    (model_dir,) = tmp_path.glob("minisparse-sglang-*")
    assert fake.instances[0].kwargs["model_path"] == str(model_dir)
    assert (model_dir / "config.json").is_file()
    backend.shutdown()
    assert ("shutdown",) in fake.instances[0].calls and not model_dir.exists()
    _backend(tiny)  # never shut down, dropped at once
    gc.collect()
    assert not list(tmp_path.glob("minisparse-sglang-*"))


def test_the_config_dir_goes_when_the_process_exits(tiny_path, tmp_path):
    """A backend still open at exit (an exception, a script that never calls shutdown)."""
    code = f"""
import sys, torch, pytest
sys.path.insert(0, {str(Path(__file__).parent)!r})
import fake_sglang
fake_sglang.install(pytest.MonkeyPatch())
torch.cuda.mem_get_info = lambda *a: (80 * 2**30, 96 * 2**30)
from minisparse.config.schema import EngineConfig
from minisparse.engine.sglang_backend import SGLangBackend
from minisparse.models.loading import load_policy
model, tok = load_policy({str(tiny_path)!r}, "float32", "cpu")
backend = SGLangBackend(model, tok, EngineConfig(), None, "cuda:0", "float32")
print(fake_sglang.Engine.instances[0].kwargs["model_path"])
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert Path(res.stdout.split()[-1]).parent == tmp_path  # it was made there
    assert not list(tmp_path.glob("minisparse-sglang-*"))


def test_kv_memory_gb_becomes_a_token_count(tiny, fake):
    _backend(tiny, kv_memory_gb=1.0, max_num_seqs=4)
    c = tiny[0].config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size //
                                                                   c.num_attention_heads) * 4
    assert kv_bytes_per_token(c, torch.float32) == per_token
    cap = 4 * c.max_position_embeddings
    assert GIB // per_token > cap  # a small model: full-length sequences bound the pool
    assert fake.instances[0].kwargs["max_total_tokens"] == cap
    _backend(tiny, kv_memory_gb=1e-4, max_model_len=64, max_num_seqs=512)
    assert int(1e-4 * GIB) // per_token < 512 * 64  # here the memory is the bound
    assert fake.instances[1].kwargs["max_total_tokens"] == int(1e-4 * GIB) // per_token


def test_memory_fraction_leaves_the_native_share_of_post_weight_memory_to_kv():
    free, weights, k = 80 * GIB, 8 * GIB, 0.8
    f = memory_fraction(k, weights, free)
    kv = (free - weights) - free * (1 - f)  # SGLang 0.5.16's pool size rule
    assert kv == pytest.approx(k * (free - weights))
    assert memory_fraction(0.5, 0, free) == pytest.approx(0.5)


def test_missing_sglang_says_how_to_install_it(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="requirements-gpu.txt"):
        _backend(tiny)


def test_a_missing_sglang_fails_before_any_model_is_loaded(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "sglang", None)
    check_backend(load_config("tiny_dense"))  # native: nothing to check
    with pytest.raises(ConfigError, match="MINISPARSE_GPU=1 bash install.sh"):
        check_backend(load_config("tiny_dense", ["engine.backend=sglang"]))
    spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
    eval_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_cli)
    monkeypatch.setattr("minisparse.models.loading.load_policy", lambda *a: pytest.fail("model loaded"))
    code = eval_cli.main(["--model", "tiny", "--backend", "sglang", "--benchmarks", "arithmetic",
                          "--limit", "2", "--output", str(tmp_path / "r")])
    assert code == 2 and "needs SGLang" in capsys.readouterr().err


def test_dense_only_and_cuda_only(tiny, fake):
    model, tok = tiny
    compress = load_config("tiny_rkv").compress
    with pytest.raises(ValueError, match="dense only"):
        SGLangBackend(model, tok, EngineConfig(), compress, "cuda:0", "float32")
    with pytest.raises(ValueError, match="CUDA"):
        SGLangBackend(model, tok, EngineConfig(), None, "cpu", "float32")


# ---- requests and outputs -------------------------------------------------------------------

def test_request_params_carry_the_native_stop_set_and_seed():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33,
                       stop_token_ids=(99,))
    sp = request_params(p, {2, 3}, seed=1234)
    assert sp["stop_token_ids"] == [2, 3, 99] and sp["sampling_seed"] == 1234
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["max_new_tokens"]) == (0.7, 0.9, 20, 33)
    assert not sp["ignore_eos"] and sp["no_stop_trim"]
    bench_like = request_params(SamplingParams(ignore_eos=True), {2, 3}, seed=0)
    assert "stop_token_ids" not in bench_like and bench_like["ignore_eos"]
    with pytest.raises(ValueError, match="ignore_eos"):
        request_params(SamplingParams(ignore_eos=True, stop_token_ids=(5,)), {2}, seed=0)


def test_parse_output_takes_tokens_and_logprobs_from_the_same_pairs():
    out = {"output_ids": [7, 8, 2], "meta_info": {
        "output_token_logprobs": [(-0.5, 7, None), (-1.5, 8, None), (-0.25, 2, None)],
        "finish_reason": {"type": "stop", "matched": 2}}}
    s = parse_output(out, 3, 1, [1, 2])
    assert (s.prompt_index, s.sample_index, s.prompt_token_ids) == (3, 1, [1, 2])
    assert s.token_ids == [7, 8, 2] and s.logprobs == [-0.5, -1.5, -0.25]
    assert s.finish_reason == "stop"
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": "x"}
    assert parse_output(out, 0, 0, [1]).finish_reason == "abort"
    out["output_ids"] = [9, 9, 9]
    with pytest.raises(RuntimeError, match="disagree"):
        parse_output(out, 0, 0, [1])
    with pytest.raises(RuntimeError, match="output_token_logprobs"):
        parse_output({"meta_info": {}}, 0, 0, [1])


def test_generate_is_prompt_major_with_per_sample_seeds(tiny, fake):
    backend = _backend(tiny)
    prompts = [[5, 6, 7], [8, 9]]
    stop = sorted(backend.eos_ids)[0]
    params = SamplingParams(n=3, max_new_tokens=40, seed=77, stop_token_ids=(30, 31))
    outs = backend.generate(prompts, params)
    _, ids, sps, logprob = fake.instances[0].calls[-1]
    assert logprob is True and ids == [prompts[0]] * 3 + [prompts[1]] * 3
    assert [sp["sampling_seed"] for sp in sps] == [seed_for(77, i) for i in range(6)]
    assert all(set(sp["stop_token_ids"]) == backend.eos_ids | {30, 31} for sp in sps)
    assert stop in sps[0]["stop_token_ids"]
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(p, j) for p in (0, 1)
                                                                for j in range(3)]
    for o in outs:
        assert o.prompt_token_ids == prompts[o.prompt_index]
        assert o.logprobs == pytest.approx([-0.01 * t for t in o.token_ids])
        if o.finish_reason == "stop":
            assert o.token_ids[-1] in {30, 31} | backend.eos_ids  # the stop token is kept
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 40
    assert "stop" in {o.finish_reason for o in outs}  # the stop branch above ran
    assert backend.last_stats.generated_tokens == sum(len(o.token_ids) for o in outs)
    again = backend.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    # a later block of one batch split over ranks: seeded as in the whole batch
    backend.generate(prompts[1:], replace(params, seed_offset=3))
    _, _, sps, _ = fake.instances[0].calls[-1]
    assert [sp["sampling_seed"] for sp in sps] == [seed_for(77, i) for i in range(3, 6)]


# ---- phases and weights ---------------------------------------------------------------------

def test_sleep_and_wake_release_and_resume_once(tiny, fake):
    backend = _backend(tiny)
    backend.sleep()
    backend.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        backend.generate([[1, 2]], SamplingParams())
    with pytest.raises(RuntimeError, match="asleep"):
        backend.update_weights(tiny[0])
    backend.wake()
    backend.wake()
    assert [c[0] for c in fake.instances[0].calls] == ["release", "resume"]


def test_weight_buckets_cover_every_parameter_once_in_bounded_buckets(tiny):
    model = tiny[0]
    limit = 40_000
    buckets = list(weight_buckets(model, torch.bfloat16, bucket_bytes=limit))
    flat = [(n, t) for b in buckets for n, t in b]
    params = dict(model.named_parameters())
    assert [n for n, _ in flat] == list(params)  # HF names, tied lm_head once
    assert "lm_head.weight" not in params and model.config.tie_word_embeddings
    for name, t in flat:
        assert t.dtype == torch.bfloat16 and t.shape == params[name].shape
        assert torch.equal(t, params[name].detach().to(torch.bfloat16))
    assert len(buckets) > 1
    for b in buckets:
        size = sum(t.numel() * 2 for _, t in b)
        assert size <= limit or len(b) == 1


def test_update_weights_pushes_every_tensor_then_flushes_the_cache(tiny, fake):
    backend = _backend(tiny)
    backend.bucket_bytes = 30_000
    model = tiny[0]
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    try:
        backend.update_weights(model)
    finally:
        with torch.no_grad():
            model.model.norm.weight.sub_(0.5)
    engine = fake.instances[0]
    updates = [c for c in engine.calls if c[0] == "update"]
    assert len(updates) > 1 and engine.calls[-1] == ("flush",)  # once, after the last
    assert engine.calls[: len(updates)] == [("update", "flattened_bucket", False, 1)] * len(updates)
    for name, p in model.named_parameters():
        expected = p.detach() + (0.5 if name == "model.norm.weight" else 0.0)
        assert torch.equal(engine.weights[name], expected), name


# ---- bench -----------------------------------------------------------------------------------

def test_bench_both_reports_the_native_over_sglang_ratio(monkeypatch, tmp_path):
    speeds = {"native": 300.0, "sglang": 200.0}
    monkeypatch.setattr(bench, "run_backend", lambda args, b: {"tokens_per_s": speeds[b],
                                                               "backend": b})
    path = tmp_path / "b.json"
    result = bench.run(bench.parse_args(["--backend", "both", "--json", str(path)]))
    assert result["native_over_sglang"] == pytest.approx(1.5)
    assert json.loads(path.read_text())["sglang"]["tokens_per_s"] == 200.0


def test_bench_both_with_compression_runs_sglang_dense(monkeypatch):
    """--backend both --compress rkv: the native engine compressed, SGLang dense (asking
    SGLang itself for compression stays an error)."""
    built = {}

    class Engine:
        def __init__(self, model, tokenizer, cfg, compress, *a, **k):
            built[type(self).__name__] = compress.algorithm

        def update_weights(self, model):
            pass

    monkeypatch.setattr(bench, "LLMEngine", type("LLMEngine", (Engine,), {}))
    import minisparse.engine.sglang_backend as sgl
    monkeypatch.setattr(sgl, "SGLangBackend", type("SGLangBackend", (Engine,), {}))
    args = bench.parse_args(["--backend", "both", "--compress", "rkv", "--device", "cpu"])
    bench.build(args, "native")
    bench.build(args, "sglang")
    assert built == {"LLMEngine": "rkv", "SGLangBackend": "none"}
    args = bench.parse_args(["--backend", "sglang", "--compress", "rkv", "--device", "cpu"])
    built.clear()
    bench.build(args, "sglang")
    assert built == {"SGLangBackend": "rkv"}  # passed through: SGLangBackend refuses it

