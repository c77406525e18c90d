"""select(): the fast path against the float64 reference, and its invariants."""
from __future__ import annotations

import itertools

import pytest
import torch

from minisparse.config.schema import rule_names

from . import reference
from .helpers import make_inputs, make_rule

BUDGET, WINDOW = 24, 4
GROUPS = (1, 2, 4, 8)
# Just above the budget up to several times it; the KV head count varies with the case.
LENGTHS = (BUDGET + 1, BUDGET + 7, 2 * BUDGET + 3, 5 * BUDGET)
GRID = list(itertools.product(("rkv", "snapkv"), ("per_head", "per_layer"),
                              ("max", "avg"), ("max", "mean"), GROUPS))


@pytest.mark.parametrize("algorithm,selection,pooling,group_pooling,group", GRID)
def test_matches_reference(algorithm, selection, pooling, group_pooling, group):
    case = GRID.index((algorithm, selection, pooling, group_pooling, group))
    length = LENGTHS[case % len(LENGTHS)]
    h_kv = 1 + case % 3
    keys, queries = make_inputs(h_kv, group, length, WINDOW, seed=case)
    rule = make_rule(algorithm, budget=BUDGET, window=WINDOW, pooling=pooling,
                         group_pooling=group_pooling, selection=selection)
    kept = rule.select(keys, queries)
    ref = reference.scores(keys, queries, algorithm, pooling=pooling,
                           group_pooling=group_pooling)
    reference.check_selection(kept, ref, length, BUDGET, WINDOW, selection, atol=1e-6)
    # The scores themselves, computed in float64 by the fast path, match the reference.
    fast = rule.score(keys.double(), queries.double())
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["rkv", "snapkv"])
def test_exact_indices_without_plateaus(algorithm):
    """kernel_size 1 in float64 leaves no ties: the very same indices as the reference."""
    keys, queries = make_inputs(2, 4, 70, WINDOW, seed=3, dtype=torch.float64)
    rule = make_rule(algorithm, budget=BUDGET, window=WINDOW, kernel_size=1)
    kept = rule.select(keys, queries)
    ref = reference.scores(keys, queries, algorithm, kernel_size=1)
    expected = ref.topk(BUDGET - WINDOW, dim=-1).indices
    expected = torch.cat([expected, torch.arange(70 - WINDOW, 70).expand(2, -1)], dim=-1)
    # The float64 scores match the reference to ~1e-12 (test above), so indices may only
    # differ between tokens whose scores are that close: with random inputs, none are.
    reference.assert_same_selection(kept, expected.sort(dim=-1).values, ref, "per_head", 1e-12)


def test_redundancy_changes_the_selection():
    """R-KV and SnapKV must differ on keys with duplicates (the penalty is live)."""
    keys, queries = make_inputs(2, 2, 96, WINDOW, seed=5)
    rkv = make_rule("rkv", budget=BUDGET, window=WINDOW).select(keys, queries)
    snap = make_rule("snapkv", budget=BUDGET, window=WINDOW).select(keys, queries)
    assert not torch.equal(rkv, snap)


def test_threshold_rule_is_exercised():
    """The test keys have similarities on both sides of 0.5 (else the duplicate rule
    would never be compared against the reference)."""
    keys, _ = make_inputs(2, 1, 96, WINDOW, seed=5)
    unit = keys / keys.norm(dim=-1, keepdim=True)
    sim = unit @ unit.transpose(-1, -2)
    off_diag = sim[:, ~torch.eye(96, dtype=torch.bool)]
    assert 0.05 < (off_diag > 0.5).float().mean() < 0.95


@pytest.mark.parametrize("algorithm", rule_names())
@pytest.mark.parametrize("selection", ["per_head", "per_layer"])
def test_invariants(algorithm, selection):
    rule = make_rule(algorithm, budget=BUDGET, window=WINDOW, selection=selection)
    for length in (BUDGET + 1, 3 * BUDGET):
        keys, queries = make_inputs(2, 4, length, WINDOW, seed=length)
        kept = rule.select(keys, queries)
        assert kept.dtype == torch.long and kept.shape == (2, BUDGET)
        for row in kept.tolist():
            assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < length
            assert row[-WINDOW:] == list(range(length - WINDOW, length))


@pytest.mark.parametrize("algorithm", rule_names())
@pytest.mark.parametrize("length", [1, WINDOW, BUDGET - 1, BUDGET])
def test_short_cache_keeps_everything(algorithm, length):
    keys, queries = make_inputs(3, 2, length, WINDOW)
    kept = make_rule(algorithm, budget=BUDGET, window=WINDOW).select(keys, queries)
    assert torch.equal(kept, torch.arange(length).expand(3, length))


def test_bfloat16_inputs_agree_by_score():
    """bf16 keys/queries: same selection as the float64 reference up to near-ties."""
    keys, queries = make_inputs(2, 8, 200, WINDOW, seed=11, dtype=torch.bfloat16)
    for algorithm in ("rkv", "snapkv"):
        kept = make_rule(algorithm, budget=BUDGET, window=WINDOW).select(keys, queries)
        ref = reference.scores(keys, queries, algorithm)
        # Near-tie tolerance: a few percent of the typical score size.
        reference.check_selection(kept, ref, 200, BUDGET, WINDOW, "per_head",
                                  atol=0.05 * float(ref.abs().mean()))


# ---- rules that score without queries ---------------------------------------------------

@pytest.mark.parametrize("n_sink,budget,expected", [
    (2, 8, [0, 1, 6, 7, 8, 9, 10, 11]),  # 2 sinks + the 6 newest
    (0, 8, [4, 5, 6, 7, 8, 9, 10, 11]),  # no sinks: a sliding window
    (4, 5, [0, 1, 2, 10, 11]),  # room for 3 of the 4 sinks besides the window of 2
])
def test_streaming_llm_by_hand(n_sink, budget, expected):
    keys, queries = make_inputs(3, 2, 12, 2, seed=1)
    rule = make_rule("streaming_llm", budget=budget, window=2, n_sink=n_sink)
    assert rule.select(keys).tolist() == [expected] * 3
    assert rule.select(keys, queries).tolist() == [expected] * 3  # queries unused


@pytest.mark.parametrize("selection", ["per_head", "per_layer"])
@pytest.mark.parametrize("n_sink", [0, 1, 4, BUDGET - WINDOW, BUDGET + 3])
def test_streaming_llm_matches_reference(selection, n_sink):
    rule = make_rule("streaming_llm", budget=BUDGET, window=WINDOW, n_sink=n_sink,
                         selection=selection)
    for length in LENGTHS:
        keys, _ = make_inputs(2, 1, length, WINDOW, seed=length)
        expected = reference.streaming_llm_kept(length, BUDGET, WINDOW, n_sink)
        assert rule.select(keys).tolist() == [expected] * 2
        ref = reference.scores(keys, None, "streaming_llm", window=WINDOW, budget=BUDGET,
                               n_sink=n_sink)
        reference.check_selection(rule.select(keys), ref, length, BUDGET, WINDOW,
                                  selection, atol=0.0)


def test_rules_that_need_queries_refuse_none():
    keys, _ = make_inputs(2, 1, 40, WINDOW)
    with pytest.raises(ValueError, match="^queries: SnapKV scores with"):
        make_rule("snapkv", budget=BUDGET, window=WINDOW).select(keys)


def test_knorm_by_hand():
    """Older key norms 3, 1, 4, 1.5, 5, 0.5, 2 (head 0) and 4, 6, 6, 0.2, 6, 6, 0.1
    (head 1); budget 4 with a window of 1 keeps the 3 lowest of each head, or per_layer
    the 3 lowest sums (7, 7, 10, 1.7, 11, 6.5, 2.1)."""
    keys = torch.zeros(2, 8, 2)
    keys[0, :7, 0] = torch.tensor([3.0, 1.0, 4.0, 1.5, 5.0, 0.5, 2.0])
    keys[1, :7, 1] = torch.tensor([4.0, 6.0, 6.0, 0.2, 6.0, 6.0, 0.1])
    keys[:, 7] = 9.0  # the window: kept whatever its norm
    kept = make_rule("knorm", budget=4, window=1).select(keys)
    assert kept.tolist() == [[1, 3, 5, 7], [0, 3, 6, 7]]
    per_layer = make_rule("knorm", budget=4, window=1, selection="per_layer").select(keys)
    assert per_layer.tolist() == [[3, 5, 6, 7]] * 2


@pytest.mark.parametrize("selection", ["per_head", "per_layer"])
def test_knorm_matches_reference(selection):
    rule = make_rule("knorm", budget=BUDGET, window=WINDOW, selection=selection)
    for length in LENGTHS:
        keys, _ = make_inputs(3, 1, length, WINDOW, seed=length)
        ref = reference.scores(keys, None, "knorm", window=WINDOW)
        reference.check_selection(rule.select(keys), ref, length, BUDGET, WINDOW,
                                  selection, atol=1e-6)
        fast = rule.score(keys.double())
        torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    keys, _ = make_inputs(2, 1, 200, WINDOW, seed=11, dtype=torch.bfloat16)
    ref = reference.scores(keys, None, "knorm", window=WINDOW)  # bf16: up to near-ties
    reference.check_selection(rule.select(keys), ref, 200, BUDGET, WINDOW, selection,
                              atol=1e-6 * float(ref.abs().mean()))


# ---- keep_prompt: protected leading positions --------------------------------------------

def test_protected_prompt_by_hand():
    """KNorm keeps the lowest norms. Norms 0.01, 0.02, 0.03 (a 3-token prompt), then
    5, 0.5, 4, 0.1, 3 and a window of 2. Budget 4: without protection the prompt's
    tiny norms win the 2 older places ([0, 1] + window); with the prompt protected it
    stays whole, outside the budget, and the 2 places go to the response's lowest norms
    (positions 6 and 4)."""
    keys = torch.zeros(1, 10, 2)
    keys[0, :8, 0] = torch.tensor([0.01, 0.02, 0.03, 5.0, 0.5, 4.0, 0.1, 3.0])
    keys[0, 8:] = 9.0
    rule = make_rule("knorm", budget=4, window=2)
    assert rule.select(keys).tolist() == [[0, 1, 8, 9]]
    assert rule.select(keys, protected=3).tolist() == [[0, 1, 2, 4, 6, 8, 9]]
    # a cache that fits prompt + budget is kept whole; one token more is compressed:
    # window 6, 7; of the older 3, 4, 5 (norms 5, 0.5, 4) the two lowest, 4 and 5
    assert rule.select(keys[:, :7], protected=3).tolist() == [list(range(7))]
    assert rule.select(keys[:, :8], protected=3).tolist() == [[0, 1, 2, 4, 5, 6, 7]]
    batch = rule.select_batch(keys[None], None, torch.tensor([10]),
                                protected=torch.tensor([3]))
    assert batch.tolist() == [[[4, 6, 8, 9]]]  # the prompt stays put, outside the result


@pytest.mark.parametrize("algorithm", rule_names())
@pytest.mark.parametrize("selection", ["per_head", "per_layer"])
def test_protected_prompt_keeps_the_rules_order_after_it(algorithm, selection):
    """With P protected positions each rule keeps all P, the window, and the top
    budget - window of its own scores among positions P .. L - W - 1."""
    rule = make_rule(algorithm, budget=BUDGET, window=WINDOW, selection=selection)
    length, prompt = 3 * BUDGET, 10
    keys, queries = make_inputs(2, 2, length, WINDOW, seed=7)
    kept = rule.select(keys, queries, protected=prompt)
    assert kept.shape == (2, prompt + BUDGET)
    scores = rule.score(keys, queries)  # [H_kv, L - W]
    if selection == "per_layer":
        scores = scores.sum(dim=0, keepdim=True).expand(2, -1)
    top = scores[:, prompt:].topk(BUDGET - WINDOW, dim=-1).values[:, -1:]
    for h, row in enumerate(kept.tolist()):
        assert row[:prompt] == list(range(prompt))
        assert row[-WINDOW:] == list(range(length - WINDOW, length))
        chosen = row[prompt:-WINDOW]
        assert all(prompt <= j < length - WINDOW for j in chosen)
        assert scores[h, chosen].min() >= top[h, 0] - 1e-6  # no better token left out


def test_protected_batch_equals_rows():
    """select_batch with per-row prompt lengths: each row as select() with its own,
    minus the protected prefix."""
    rule = make_rule("rkv", budget=BUDGET, window=WINDOW, pooling="avg")
    lengths, prompts = [BUDGET + 6, 3 * BUDGET, 2 * BUDGET + 5], [5, 17, 0]
    rows = [make_inputs(2, 2, n, WINDOW, seed=20 + i) for i, n in enumerate(lengths)]
    keys = torch.zeros(3, 2, max(lengths), 16)
    for i, (k, _) in enumerate(rows):
        keys[i, :, :k.shape[1]] = k
    queries = torch.stack([q for _, q in rows])
    kept = rule.select_batch(keys, queries, torch.tensor(lengths),
                               protected=torch.tensor(prompts))
    assert kept.shape == (3, 2, BUDGET)
    for i, ((k, q), p) in enumerate(zip(rows, prompts)):
        assert torch.equal(kept[i], rule.select(k, q, protected=p)[:, p:])
    with pytest.raises(ValueError, match="protected \\+ budget"):
        rule.select_batch(keys, queries, torch.tensor(lengths),
                            protected=torch.tensor([7, 17, 0]))  # 30 - 7 < budget + 1
