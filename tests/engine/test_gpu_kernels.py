"""The compiled Triton kernels on CUDA (skipped without it): the fused sampler at the real
vocabulary, the elementwise kernels, compaction's copies and its fused scores, against the
PyTorch references. Kept apart from the interpreter tests, which switch Triton to its
interpreter for the whole process; run this module in its own pytest process on a GPU
machine."""
from __future__ import annotations

import pytest
import torch

import test_fused_ops as cpu_ops
import test_sampler_triton as cpu_sampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("T,k,p", cpu_sampler.CASES)
def test_sampler_matches_reference_at_full_vocab(T, k, p):
    from minisparse.engine.layers import sampler_triton

    logits, seeds, steps = cpu_sampler._inputs(256, 151_936, seed=5, device="cuda",
                                               dtype=torch.bfloat16)
    # log-space race vs the reference's p / E: rounding may flip a near-tie, rarely
    cpu_sampler._check(sampler_triton, logits, seeds, steps, T, k, p, max_mismatch=2)


@pytest.fixture(scope="module")
def ops():
    from minisparse.engine.layers import fused_ops
    return fused_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_kernels(ops, dtype):
    cpu_ops.test_add_rms_norm(ops, "cuda", dtype)
    for heads in ((4, 2), (6, 2), (6, 3)):
        cpu_ops.test_rope_and_cache_write(ops, "cuda", dtype, *heads)
    cpu_ops.test_silu_mul(ops, "cuda", dtype)
    cpu_ops.test_split_k_partials_summed_by_add_rms_norm(ops, "cuda", dtype)


def test_rope_query_ring_write(ops):
    cpu_ops.test_rope_writes_query_ring_rows(ops, "cuda")


@pytest.mark.parametrize("budget,L", [(40, 47), (70, 90)])
def test_compaction_copies(budget, L):
    import test_triton_compaction as cpu_tc
    from minisparse.engine import triton_compaction

    cpu_tc.check_gather(triton_compaction, "cuda", 128)
    cpu_tc.check_ring(triton_compaction, "cuda", 128, window=8, h_q=12)
    cpu_tc.check_compact(triton_compaction, "cuda", 128, budget, L)
    cpu_tc.check_compact(triton_compaction, "cuda", 128, budget, L, protected=(5, 0, 3))


@pytest.mark.parametrize("algorithm,settings", [("rkv", {}), ("snapkv", {})])
def test_fused_scores(algorithm, settings):
    """At the 1.5B's heads (12 query, 2 KV, 128 wide): float32 as the rule scores; in
    bfloat16 tensor cores sum in another order, so a similarity on the threshold may round
    the other way and move one column of R-KV's redundancy."""
    import test_triton_scores as cpu_ts
    from minisparse.engine import triton_scores

    cpu_ts.check_scores(triton_scores, algorithm, settings, 12, 2, 128, torch.float32, "cuda")
    cpu_ts.check_scores(triton_scores, algorithm, settings, 12, 2, 128, torch.bfloat16, "cuda",
                        rtol=1e-2, min_close=0.98)


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_fused_scores_compaction(monkeypatch, algorithm):
    import test_triton_scores as cpu_ts
    from minisparse.engine import triton_scores

    cpu_ts.check_keep(triton_scores, algorithm, {}, 12, 2, 128, torch.float32, "cuda")
    cpu_ts.check_compaction(triton_scores, monkeypatch, algorithm, {}, "per_head",
                            torch.float32, "cuda", 12, 2, 128)


def test_compaction_kernels_are_built_when_the_engine_starts(monkeypatch):
    """A compressed engine builds every compaction kernel it will launch when it starts:
    rollouts whose events all take the fused scoring kernel, then all the rule's path,
    at every event size and cache length they meet, build none."""
    import importlib

    from triton.runtime.jit import JITFunction

    from engine_helpers import build, make_engine, prompts
    from minisparse.compression.rules.rkv import RKV
    from minisparse.config.schema import CompressConfig
    from minisparse.engine import SamplingParams, compaction

    kernels = [k for name in ("minisparse.engine.triton_compaction",
                              "minisparse.engine.triton_scores",
                              "minisparse.compression.triton_redundancy")
               for k in vars(importlib.import_module(name)).values()
               if isinstance(k, JITFunction) and k.fn.__name__.endswith("_kernel")]
    device = torch.cuda.current_device()

    def builds() -> int:
        return sum(len(k.device_caches[device][0]) for k in kernels)

    cfg = CompressConfig(algorithm="rkv", budget=24, window=4, divide_length=8)
    model = build("qwen2", dtype=torch.bfloat16, device="cuda")
    engine = make_engine(model, cfg, page_size=16, kv_memory_gb=0.5)
    built = builds()
    assert built >= 5
    paths = []
    for name in ("_fused_select", "_select"):
        real = getattr(compaction, name)
        monkeypatch.setattr(compaction, name,
                            lambda *a, _real=real, _name=name: paths.append(_name) or _real(*a))
    for cap, path in ((float("inf"), "_fused_select"), (0, "_select")):
        monkeypatch.setitem(compaction._FUSED_MAX_WORK, RKV.score_batch, cap)
        paths.clear()
        engine.generate(prompts(6, lo=5, hi=40), SamplingParams(
            n=2, max_new_tokens=64, seed=1, ignore_eos=True))
        assert set(paths) == {path} and len(paths) >= 5
        assert builds() == built, path
