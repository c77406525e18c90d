"""The decode-step profile's host side: kernels sorted into the parts of a step, caches
laid out for the timed step, and the one-line refusal without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine_helpers import build, make_engine
from minisparse.bench import profile
from minisparse.compression import build_rule
from minisparse.config.schema import CompressConfig


@pytest.mark.parametrize("kernel,kind", [
    ("nvjet_sm90_tst_192x16_64x8_4x1_v_bz_TNT", "GEMM"),
    ("_split_kernel", "attention"),
    ("_add_rms_kernel", "RMSNorm"),
    ("_norms_sums_kernel", "redundancy"),  # "norms" holds "rms": not the RMSNorm
    ("_scores_kernel", "fused scores"),
    ("_silu_mul_kernel", "SiLU*up"),
    ("_partial_kernel", "sampler"),
    ("void at::native::radixSortKVInPlace<2, -1, 32, 32, short, long>", "top-k and sort"),
    ("void at::native::vectorized_gather_kernel<16, long>", "gather/scatter"),
    ("something_new", "other"),
])
def test_kernels_are_sorted_into_the_parts_of_a_step(kernel, kind):
    assert profile.kind_of(kernel) == kind


def test_parts_sum_their_kernels_largest_first():
    rows = [dict(kind="GEMM", us=3.0), dict(kind="attention", us=4.0),
            dict(kind="GEMM", us=2.5)]
    assert list(profile.by_kind(rows).items()) == [("GEMM", 5.5), ("attention", 4.0)]


def test_parts_inside_the_cuda_graph_print_beside_the_eager_ones(capsys):
    kernels = [dict(kernel="_split_kernel", launches=28, us=896.0, share=0.6),
               dict(kernel="nvjet_gemm", launches=28, us=600.0, share=0.4)]
    step = dict(kinds={"attention": 896.0, "GEMM": 600.0}, kernels=kernels,
                graph_kinds={"attention": 756.0, "GEMM": 598.5})
    profile.print_kernels(step, top=2)
    parts = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert parts[0] == "| part | us / step | share | in the CUDA graph, us |"
    assert parts[2:] == ["| attention | 896.0 | 59.9% | 756.0 |", "| GEMM | 600.0 | 40.1% | 598.5 |"]
    profile.print_kernels(dict(step, graph_kinds={}), top=2)  # eager: no graph column
    assert capsys.readouterr().out.splitlines()[0] == "| part | us / step | share |"


def test_compaction_is_scored_each_way_asked_where_the_fused_kernel_serves(monkeypatch):
    pool = SimpleNamespace(k=torch.zeros(1, 1, 1, 16))
    rkv = build_rule(CompressConfig(algorithm="rkv"))
    assert profile.compaction_modes(SimpleNamespace(rule=None, pool=pool), "both") == []
    engine = SimpleNamespace(rule=rkv, pool=pool)
    assert profile.compaction_modes(engine, "both") == [False]  # CPU: the rule's path only
    monkeypatch.setattr(profile, "fused_scorer", lambda pool, rule, sequences, entries: object())
    assert profile.compaction_modes(engine, "both") == [True, False]
    assert profile.compaction_modes(engine, "fused") == [True]
    assert profile.compaction_modes(engine, "rule") == [False]


def test_caches_fill_spread_out_pages_with_random_entries():
    engine = make_engine(build("qwen2"), page_size=4)
    pool = engine.pool
    rows = profile.fill_caches(engine, batch=3, length=10)
    assert rows.tolist() == [0, 1, 2]
    pages = pool.page_table[:3, :3]  # 10 entries: 3 pages each, every other page
    assert pages.tolist() == [[0, 2, 4], [6, 8, 10], [12, 14, 16]]
    used = pool.slots(rows, 10)
    assert bool(pool.k[:, used].abs().sum(-1).gt(0).all())


def test_too_many_caches_for_the_pool_is_one_line():
    engine = make_engine(build("qwen2"), page_size=4)
    with pytest.raises(SystemExit, match="need .* pages spread out; the pool has"):
        profile.fill_caches(engine, batch=16, length=4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only machines")
def test_without_a_gpu_the_profile_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        profile.main(["--model", "tiny"])


def test_the_engine_gets_a_row_for_every_sequence_of_the_largest_batch():
    args = profile.build_parser().parse_args(["--batch", "512,1024"])
    assert profile.batch_sizes(args) == [512, 1024]
    assert getattr(args, "engine.max_num_seqs") == 1024  # the page table's rows
    assert profile.bench_config(args).engine.max_num_seqs == 1024


def test_a_batch_past_the_engine_rows_given_is_refused_naming_both():
    args = profile.build_parser().parse_args(["--batch", "16,1024", "--max-num-seqs", "512"])
    with pytest.raises(SystemExit, match="--batch 1024 needs --max-num-seqs of at least 1024 "
                                         r"\(given 512\)"):
        profile.batch_sizes(args)
    args = profile.build_parser().parse_args(["--batch", "16,x"])
    with pytest.raises(SystemExit, match="comma-separated integers"):
        profile.batch_sizes(args)
