"""select_batch(): row-by-row equality with select(), padding isolation, chunking; the
shape checks and build_rule (the settings' checks are the config's: tests/config)."""
from __future__ import annotations

import pytest
import torch

from minisparse.compression import RKV, ScoringRule, SnapKV, build_rule, rule_class
from minisparse.config.schema import CompressConfig, ConfigError, rule_names

from . import reference
from .helpers import make_inputs, make_rule

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
    rule = make_rule(algorithm, budget=BUDGET, window=WINDOW, selection=selection,
                         pooling=pooling)
    kept = rule.select_batch(keys, queries, torch.tensor(lengths))
    assert kept.shape == (len(lengths), 2, BUDGET) and kept.dtype == torch.long
    for b, ((k, q), n) in enumerate(zip(rows, lengths)):
        single = rule.select(k, q)
        ref = reference.scores(k, q, algorithm, pooling=pooling)
        # float32 scores of size ~1 agree with the float64 reference to ~1e-7 whatever the
        # batch shape; 1e-6 leaves a 10x margin and still catches any wrong pick.
        reference.check_selection(kept[b], ref, n, BUDGET, WINDOW, selection, 1e-6)
        if pooling == "avg":  # no plateaus: the same picks, up to float near-ties
            reference.assert_same_selection(kept[b], single, ref, selection, 1e-6)


def test_chunking_does_not_change_results():
    lengths = [BUDGET + 3, 2 * BUDGET, 3 * BUDGET, BUDGET + 9, 2 * BUDGET + 1]
    keys, queries, _ = padded_batch(lengths, 2, 2, 0.0, lmax=3 * BUDGET)
    cfg = CompressConfig(algorithm="rkv", budget=BUDGET, window=WINDOW, pooling="avg")
    rule = RKV(cfg)
    lengths = torch.tensor(lengths)
    whole = rule.select_batch(keys, queries, lengths)
    assert rule.rows_per_chunk(keys, queries, chunk_bytes=1) == 1
    assert rule.rows_per_chunk(keys, queries) >= len(lengths)
    small = RKV(cfg, chunk_bytes=1)
    # Chunks run the same float32 arithmetic on other batch shapes: the same picks up to
    # near-ties within float32 rounding of the scores (1e-6, as above).
    for chunked in (rule.select_batch(keys, queries, lengths, chunk_bytes=1),
                    small.select_batch(keys, queries, lengths)):
        for b, n in enumerate(lengths.tolist()):
            ref = reference.scores(keys[b, :, :n], queries[b], "rkv", pooling="avg")
            reference.assert_same_selection(chunked[b], whole[b], ref, "per_head", 1e-6)


def test_chunk_size_follows_similarity_memory():
    """The R-KV estimate covers its L x L similarity matrix; SnapKV needs less."""
    keys = torch.zeros(1, 2, 640, 128, dtype=torch.bfloat16)
    queries = torch.zeros(1, 16, 8, 128, dtype=torch.bfloat16)
    cap = 1 << 30
    rkv_rows = RKV(CompressConfig()).rows_per_chunk(keys, queries, cap)
    assert rkv_rows * 2 * 640 * 640 * 2 <= cap  # bf16 similarity entries alone fit
    assert SnapKV(CompressConfig()).rows_per_chunk(keys, queries, cap) > rkv_rows


def test_empty_batch():
    keys, queries = torch.zeros(0, 2, 40, 16), torch.zeros(0, 4, WINDOW, 16)
    kept = make_rule("rkv", budget=BUDGET, window=WINDOW).select_batch(
        keys, queries, torch.zeros(0, dtype=torch.long))
    assert kept.shape == (0, 2, BUDGET)


def _batch_args(lengths=(30, 40), lmax=40, h_kv=2, h_q=4, window=WINDOW, dim=16):
    return (torch.zeros(len(lengths), h_kv, lmax, dim),
            torch.zeros(len(lengths), h_q, window, dim), torch.tensor(lengths))


def test_bad_chunk_bytes():
    with pytest.raises(ValueError, match="^chunk_bytes:"):
        RKV(CompressConfig(), chunk_bytes=0)


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
        make_rule("rkv", budget=BUDGET, window=WINDOW).select_batch(*args)


def test_bad_single_shapes():
    rule = make_rule("snapkv", budget=BUDGET, window=WINDOW)
    with pytest.raises(ValueError, match="^keys:"):
        rule.select(torch.zeros(1, 2, 40, 16), torch.zeros(4, WINDOW, 16))
    with pytest.raises(ValueError, match="^queries:"):
        rule.select(torch.zeros(2, 40, 16), torch.zeros(5, WINDOW, 16))


def test_build_rule():
    assert build_rule(CompressConfig(algorithm="none")) is None
    assert type(build_rule(CompressConfig(algorithm="rkv"))) is RKV
    assert type(build_rule(CompressConfig(algorithm="snapkv"))) is SnapKV
    assert type(build_rule(CompressConfig(algorithm="streaming_llm"))).__name__ == \
        "StreamingLLM"
    assert type(build_rule(CompressConfig(algorithm="knorm"))).__name__ == "KNorm"
    names = {name: rule_class(name).name for name in rule_names()}  # what reports say
    assert names.items() >= {"knorm": "KNorm", "rkv": "R-KV", "snapkv": "SnapKV",
                             "streaming_llm": "StreamingLLM"}.items()


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_rule_uses_its_config(algorithm):
    """Every setting of the CompressConfig reaches the selection: the scores equal the
    reference's with these values (none of them the defaults), and the kept positions are
    `budget` per layer (per_layer: the same for every head), the last `window` included."""
    cfg = CompressConfig(algorithm=algorithm, budget=20, window=3, kernel_size=5,
                         pooling="avg", group_pooling="mean", mix_lambda=0.3,
                         sim_threshold=0.2, selection="per_layer")
    keys, queries = make_inputs(2, 2, 50, 3, seed=5, dtype=torch.float64)
    rule = build_rule(cfg)
    ref = reference.scores(keys, queries, algorithm, kernel_size=5, pooling="avg",
                           group_pooling="mean", mix_lambda=0.3, sim_threshold=0.2)
    torch.testing.assert_close(rule.score(keys, queries), ref, rtol=1e-9, atol=1e-12)
    default = reference.scores(keys, queries, algorithm)
    assert not torch.allclose(ref, default)  # the settings change the scores
    kept = rule.select(keys, queries)
    assert kept.shape == (2, 20) and (kept[0] == kept[1]).all()
    assert kept[0, -3:].tolist() == [47, 48, 49]
    reference.check_selection(kept, ref, 50, 20, 3, "per_layer", 1e-9)


@pytest.mark.parametrize("algorithm", ["knorm", "streaming_llm"])
@pytest.mark.parametrize("selection", ["per_head", "per_layer"])
@pytest.mark.parametrize("fill", [0.0, float("nan"), 1e4])
def test_query_free_batch_equals_rows(algorithm, selection, fill):
    """Rules that score without queries take none in a batch too (the engine has none for
    them); padding stays out of every row's scores."""
    lengths = [BUDGET + 1, 3 * BUDGET, 2 * BUDGET + 5, BUDGET + 2, 4 * BUDGET - 1]
    keys, _, rows = padded_batch(lengths, 2, 1, fill, lmax=4 * BUDGET + 3)
    rule = make_rule(algorithm, budget=BUDGET, window=WINDOW, selection=selection)
    assert not rule.uses_queries
    kept = rule.select_batch(keys, None, torch.tensor(lengths))
    assert kept.shape == (len(lengths), 2, BUDGET) and kept.dtype == torch.long
    for b, ((k, _), n) in enumerate(zip(rows, lengths)):
        ref = reference.scores(k, None, algorithm, window=WINDOW, budget=BUDGET)
        reference.check_selection(kept[b], ref, n, BUDGET, WINDOW, selection, 1e-6)
        reference.assert_same_selection(kept[b], rule.select(k), ref, selection, 1e-6)


def test_rule_class_names_the_rules():
    with pytest.raises(ConfigError) as err:
        rule_class("h2o")
    assert str(err.value) == (f"compress.algorithm='h2o': no rule h2o in "
                              f"minisparse/compression/rules/ ({', '.join(rule_names())}); "
                              f"a rule of your own is module.path:ClassName")
    assert {"knorm", "rkv", "snapkv", "streaming_llm"} <= set(rule_names())
    assert rule_class("rkv") is RKV and issubclass(RKV, ScoringRule)
