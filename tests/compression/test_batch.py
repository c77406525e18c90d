"""select_batch(): row-by-row equality with select(), padding isolation, chunking; the
parameter checks and build_policy."""
from __future__ import annotations

import pytest
import torch

from minisparse.compression import RKV, SnapKV, build_policy
from minisparse.config.schema import CompressConfig

from . import reference
from .helpers import make_inputs, make_policy

BUDGET, WINDOW = 24, 4


def padded_batch(lengths: list[int], h_kv: int, group: int, fill: float, lmax: int,
                 dtype: torch.dtype = torch.float32):
    """Rows from make_inputs, padded to lmax with `fill` (NaN / inf probe isolation)."""
    keys = torch.full((len(lengths), h_kv, lmax, 16), fill, dtype=dtype)
    rows = [make_inputs(h_kv, group, n, WINDOW, seed=100 + i, dtype=dtype)
            for i, n in enumerate(lengths)]
    for i, (k, _) in enumerate(rows):
        keys[i, :, : k.shape[1]] = k
    queries = torch.stack([q for _, q in rows])
    return keys, queries, rows


CASES = [("rkv", "per_head", "avg"), ("rkv", "per_layer", "max"),
         ("snapkv", "per_head", "max"), ("snapkv", "per_layer", "avg")]


@pytest.mark.parametrize("algorithm,selection,pooling", CASES)
@pytest.mark.parametrize("fill", [0.0, float("nan"), 1e4])
def test_batch_equals_rows(algorithm, selection, pooling, fill):
    lengths = [BUDGET + 1, 3 * BUDGET, 2 * BUDGET + 5, BUDGET + 2, 4 * BUDGET - 1]
    keys, queries, rows = padded_batch(lengths, 2, 4, fill, lmax=4 * BUDGET + 3)
    policy = make_policy(algorithm, budget=BUDGET, window=WINDOW, selection=selection,
                         pooling=pooling)
    kept = policy.select_batch(keys, queries, torch.tensor(lengths))
    assert kept.shape == (len(lengths), 2, BUDGET) and kept.dtype == torch.long
    for b, ((k, q), n) in enumerate(zip(rows, lengths)):
        single = policy.select(k, q)
        ref = reference.scores(k, q, algorithm, pooling=pooling)
        # float32 scores of size ~1 agree with the float64 reference to ~1e-7 whatever the
        # batch shape; 1e-6 leaves a 10x margin and still catches any wrong pick.
        reference.check_selection(kept[b], ref, n, BUDGET, WINDOW, selection, 1e-6)
        if pooling == "avg":  # no plateaus: the same picks, up to float near-ties
            reference.assert_same_selection(kept[b], single, ref, selection, 1e-6)


def test_chunking_does_not_change_results():
    lengths = [BUDGET + 3, 2 * BUDGET, 3 * BUDGET, BUDGET + 9, 2 * BUDGET + 1]
    keys, queries, _ = padded_batch(lengths, 2, 2, 0.0, lmax=3 * BUDGET)
    policy = RKV(budget=BUDGET, window=WINDOW, pooling="avg")
    lengths = torch.tensor(lengths)
    whole = policy.select_batch(keys, queries, lengths)
    assert policy.rows_per_chunk(keys, queries, chunk_bytes=1) == 1
    assert policy.rows_per_chunk(keys, queries) >= len(lengths)
    small = RKV(budget=BUDGET, window=WINDOW, pooling="avg", chunk_bytes=1)
    # Chunks run the same float32 arithmetic on other batch shapes: the same picks up to
    # near-ties within float32 rounding of the scores (1e-6, as above).
    for chunked in (policy.select_batch(keys, queries, lengths, chunk_bytes=1),
                    small.select_batch(keys, queries, lengths)):
        for b, n in enumerate(lengths.tolist()):
            ref = reference.scores(keys[b, :, :n], queries[b], "rkv", pooling="avg")
            reference.assert_same_selection(chunked[b], whole[b], ref, "per_head", 1e-6)


def test_chunk_size_follows_similarity_memory():
    """The R-KV estimate covers its L x L similarity matrix; SnapKV needs less."""
    keys = torch.zeros(1, 2, 640, 128, dtype=torch.bfloat16)
    queries = torch.zeros(1, 16, 8, 128, dtype=torch.bfloat16)
    cap = 1 << 30
    rkv_rows = RKV().rows_per_chunk(keys, queries, cap)
    assert rkv_rows * 2 * 640 * 640 * 2 <= cap  # bf16 similarity entries alone fit
    assert SnapKV().rows_per_chunk(keys, queries, cap) > rkv_rows


def test_empty_batch():
    keys, queries = torch.zeros(0, 2, 40, 16), torch.zeros(0, 4, WINDOW, 16)
    kept = RKV(budget=BUDGET, window=WINDOW).select_batch(keys, queries,
                                                          torch.zeros(0, dtype=torch.long))
    assert kept.shape == (0, 2, BUDGET)


def _batch_args(lengths=(30, 40), lmax=40, h_kv=2, h_q=4, window=WINDOW, dim=16):
    return (torch.zeros(len(lengths), h_kv, lmax, dim),
            torch.zeros(len(lengths), h_q, window, dim), torch.tensor(lengths))


@pytest.mark.parametrize("kwargs,name", [
    (dict(budget=4, window=4), "budget"),
    (dict(budget=8, window=0), "window"),
    (dict(kernel_size=4), "kernel_size"),
    (dict(kernel_size=0), "kernel_size"),
    (dict(pooling="mean"), "pooling"),
    (dict(group_pooling="avg"), "group_pooling"),
    (dict(selection="global"), "selection"),
    (dict(chunk_bytes=0), "chunk_bytes"),
    (dict(mix_lambda=1.5), "mix_lambda"),
    (dict(sim_threshold=2.0), "sim_threshold"),
])
def test_bad_parameters(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        RKV(**kwargs)


@pytest.mark.parametrize("args,name", [
    (_batch_args(lengths=(24, 40)), "lengths"),  # not above the budget
    (_batch_args(lengths=(30, 41)), "lengths"),  # beyond Lmax
    (_batch_args(h_q=3), "queries"),  # not a multiple of H_kv
    (_batch_args(window=WINDOW + 1), "queries"),  # window mismatch
    ((torch.zeros(2, 2, 40, 16), torch.zeros(2, 4, WINDOW, 8), torch.tensor([30, 40])),
     "queries"),  # head dim mismatch
    ((torch.zeros(2, 2, 40, 16), torch.zeros(3, 4, WINDOW, 16), torch.tensor([30, 40])),
     "queries"),  # batch mismatch
    ((torch.zeros(2, 2, 40, 16), torch.zeros(2, 4, WINDOW, 16), torch.tensor([30])),
     "lengths"),
    ((torch.zeros(2, 40, 16), torch.zeros(2, 4, WINDOW, 16), torch.tensor([30, 40])),
     "keys"),
])
def test_bad_batch_shapes(args, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        RKV(budget=BUDGET, window=WINDOW).select_batch(*args)


def test_bad_single_shapes():
    policy = SnapKV(budget=BUDGET, window=WINDOW)
    with pytest.raises(ValueError, match="^keys:"):
        policy.select(torch.zeros(1, 2, 40, 16), torch.zeros(4, WINDOW, 16))
    with pytest.raises(ValueError, match="^queries:"):
        policy.select(torch.zeros(2, 40, 16), torch.zeros(5, WINDOW, 16))


def test_build_policy():
    assert build_policy(CompressConfig(algorithm="none")) is None
    cfg = CompressConfig(algorithm="rkv", budget=64, window=4, kernel_size=5, pooling="avg",
                         group_pooling="mean", mix_lambda=0.3, sim_threshold=0.7,
                         selection="per_layer")
    rkv = build_policy(cfg)
    assert type(rkv) is RKV
    assert (rkv.budget, rkv.window, rkv.kernel_size, rkv.pooling, rkv.group_pooling,
            rkv.mix_lambda, rkv.sim_threshold, rkv.selection) == (
        64, 4, 5, "avg", "mean", 0.3, 0.7, "per_layer")
    snap = build_policy(CompressConfig(algorithm="snapkv", budget=32))
    assert type(snap) is SnapKV and snap.budget == 32
    with pytest.raises(ValueError, match="^algorithm:"):
        build_policy(CompressConfig(algorithm="h2o"))
    with pytest.raises(ValueError, match="^budget:"):
        build_policy(CompressConfig(algorithm="rkv", budget=8, window=8))
