"""What the engine records for the decode bound and the benchmarks (GenerateStats): device
time per phase, the entries each decode step attends, and the KV pool's share of memory."""
from __future__ import annotations

import torch

from engine_helpers import make_engine, prompts
from minisparse.config.schema import CompressConfig
from minisparse.engine import SamplingParams


def test_engine_records_phase_device_time(qwen2):
    cfg = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel_size=3)
    engine = make_engine(qwen2, cfg, page_size=4)
    engine.generate(prompts(3, lo=5, hi=9), SamplingParams(max_new_tokens=40, seed=0,
                                                           ignore_eos=True))
    s = engine.last_stats
    assert s.compress_events > 0 and s.compressions >= s.compress_events
    assert s.prefill_s > 0 and s.decode_s > 0 and s.compress_s > 0
    assert s.prefill_s + s.decode_s + s.compress_s <= s.wall_s


def test_engine_records_attended_entries_per_decode_step(qwen2):
    ps = prompts(4, lo=5, hi=12)
    new = 9
    engine = make_engine(qwen2, page_size=4)
    engine.generate(ps, SamplingParams(max_new_tokens=new, seed=0, ignore_eos=True))
    s = engine.last_stats
    # the first token comes from prefill; decode step i (1..new-1) attends prompt + i entries
    assert s.decode_tokens == 4 * (new - 1) and s.decode_steps == new - 1
    assert s.decode_kv_tokens == sum((new - 1) * len(p) + new * (new - 1) // 2 for p in ps)


def test_compressed_caches_shrink_the_recorded_reads(qwen2):
    ps = prompts(4, lo=5, hi=12)
    params = SamplingParams(max_new_tokens=60, seed=0, ignore_eos=True)
    dense = make_engine(qwen2, page_size=4)
    dense.generate(ps, params)
    cfg = CompressConfig(algorithm="rkv", budget=16, window=4, divide_length=8, kernel_size=3)
    sparse = make_engine(qwen2, cfg, page_size=4)
    sparse.generate(ps, params)
    assert sparse.last_stats.compressions > 0
    assert sparse.last_stats.decode_tokens == dense.last_stats.decode_tokens
    assert sparse.last_stats.decode_kv_tokens <= (16 + 8 + 1) * sparse.last_stats.decode_tokens
    assert sparse.last_stats.decode_kv_tokens < dense.last_stats.decode_kv_tokens


def test_fused_weight_copy_is_paid_from_the_pool_budget(monkeypatch):
    """fraction * (free + copy) - copy: with the copy made first, the engine's total stays
    fraction * (free before the copy), as it was without fused weights."""
    from minisparse.config.schema import EngineConfig
    from minisparse.engine.kv_pool import pool_bytes

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (97 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # "cuda" reads the index
    cfg, cuda = EngineConfig(kv_memory_fraction=0.8), torch.device("cuda", 0)
    assert pool_bytes(cfg, cuda) == int(0.8 * 97 * gib)
    copy = 3 * gib  # free was 100 GiB before the copy
    assert pool_bytes(cfg, cuda, copy) + copy == int(0.8 * 100 * gib)
    assert pool_bytes(cfg, cuda, 500 * gib) == 0
    assert pool_bytes(EngineConfig(kv_memory_gb=2.0), cuda, copy) == 2 * gib


def test_stats_say_whether_the_fast_path_ran(qwen2, monkeypatch):
    """On a CPU no decode step replays a CUDA graph and the forward is the reference one;
    each launch that replays a graph counts once, and the kernel path is reported where
    the forward takes it (here with the interpreted kernels offered for CPU)."""
    import minisparse.engine.engine as engine_mod
    import minisparse.engine.models as models_mod
    from minisparse.engine.model_runner import DecodeLaunch
    from minisparse.engine.sequence import GenerateStats
    from triton_interpreter import import_interpreted

    engine = make_engine(qwen2, page_size=4)
    engine.generate(prompts(2, lo=5, hi=9), SamplingParams(max_new_tokens=6, seed=0,
                                                           ignore_eos=True))
    s = engine.last_stats
    assert s.decode_steps == 5 and s.graph_steps == 0 and s.fused_kernels is False
    stats = GenerateStats()
    for graph in (True, False, True):
        launch = DecodeLaunch([], None, None, None, None, [], graph)
        engine_mod._count_decode(launch, stats)
    assert (stats.decode_steps, stats.graph_steps) == (3, 2)
    ops = import_interpreted("minisparse.engine.layers.fused_ops")
    monkeypatch.setattr(models_mod, "fused_ops", lambda h: ops)
    engine.lm.fuse_weights()
    assert engine.lm.runs_kernels(engine.device)
