"""engine.triton_scores under Triton's interpreter against the rules' own score_batch and
select_batch: the scores of every older entry, the entries kept per head, then a whole
compaction (every value of the pool after it), for SnapKV and R-KV, sequences of
different lengths on shuffled pages that split them, protected prompts and GQA groups of
2 and 6 query heads a KV head."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minisparse.compression import build_rule
from minisparse.config.schema import CompressConfig
from minisparse.engine import compaction
from minisparse.engine.kv_pool import KVPool
from triton_interpreter import import_interpreted

LAYERS, PS, W, SEQS, PAGES_EACH = 2, 4, 4, 4, 24
LENS, PROTECTED = (45, 70, 37, 66), (0, 10, 5, 3)  # rows 3, 0, 2, 1 of the pool


@pytest.fixture(scope="module")
def ts():
    pytest.importorskip("triton")
    import_interpreted("minisparse.compression.triton_redundancy")  # the kernel calls it
    return import_interpreted("minisparse.engine.triton_scores")


def _pool(h_q: int, h_kv: int, d: int, dtype: torch.dtype = torch.float32,
          device: str = "cpu", seed: int = 0):
    """Keys sharing a per-head direction of random strength, with near-duplicates (so
    R-KV's similarities spread across its threshold), on shuffled pages; a full ring."""
    g = torch.Generator().manual_seed(seed)
    slots = (SEQS * PAGES_EACH + 1) * PS
    common = torch.randn(1, 1, h_kv, d, generator=g)
    k = torch.rand(LAYERS, slots, h_kv, 1, generator=g) * 1.5 * common
    k += torch.randn(LAYERS, slots, h_kv, d, generator=g)
    dup = torch.randint(0, slots, (slots // 8, 2), generator=g)
    k[:, dup[:, 1]] = k[:, dup[:, 0]] + 0.05 * torch.randn(LAYERS, len(dup), h_kv, d, generator=g)
    pages = torch.randperm(SEQS * PAGES_EACH, generator=g).view(SEQS, PAGES_EACH)
    table = torch.zeros(SEQS + 1, PAGES_EACH + 2, dtype=torch.long)
    table[:SEQS, :PAGES_EACH] = pages
    ring = 2.0 * torch.randn(LAYERS, (SEQS + 1) * W, h_q, d, generator=g)
    v, table = torch.randn(k.shape, generator=g), table.to(device)
    pool = SimpleNamespace(k=k.to(device, dtype), v=v.to(device, dtype), page_table=table,
                           page_size=PS, device=torch.device(device), window=W,
                           q_ring=ring.to(device, dtype))
    pool.slot_of = lambda rows, index: table[rows, index // PS] * PS + index % PS
    pool.ring_queries = lambda rows, next_pos: KVPool.ring_queries(pool, rows, next_pos)
    return pool


def _rule(algorithm: str, **settings):
    return build_rule(CompressConfig(algorithm=algorithm, budget=24, window=W, kernel_size=5,
                                     **settings))


RULES = [("rkv", {}), ("rkv", dict(pooling="avg", group_pooling="mean", sim_threshold=0.3)),
         ("snapkv", dict(pooling="avg")), ("snapkv", dict(group_pooling="mean"))]
HEADS = [(6, 3, 16), (12, 2, 32)]  # query heads, KV heads, head dim


def check_scores(ts, algorithm: str, settings: dict, h_q: int, h_kv: int, d: int,
                 dtype: torch.dtype, device: str = "cpu", rtol: float = 1e-4,
                 min_close: float = 1.0) -> None:
    """The kernel's scores against score_batch's on the gathered keys and ring queries, at
    every older entry of every row: all of them within rtol (min_close: that share)."""
    pool, rule = _pool(h_q, h_kv, d, dtype, device), _rule(algorithm, **settings)
    rows, lens = torch.tensor([3, 0, 2, 1], device=device), torch.tensor(LENS, device=device)
    lmax = max(LENS)
    got = ts.scores(pool.k, pool.q_ring, pool.page_table, PS, rows, lens, lmax, rule.cfg,
                    algorithm == "rkv")
    keys = compaction._gather_keys(pool, rows, lmax).view(-1, h_kv, lmax, d)
    queries = pool.ring_queries(rows, torch.tensor([5, 2, 0, 7], device=device))
    want = rule.score_batch(keys, queries.view(-1, h_q, W, d), lens.repeat_interleave(LAYERS))
    assert got.shape == want.shape == (len(LENS) * LAYERS, h_kv, lmax)
    close = torch.cat([torch.isclose(got[r, :, :n - W], want[r, :, :n - W].float(), rtol=rtol,
                                     atol=1e-7).flatten()
                       for r, n in enumerate(lens.repeat_interleave(LAYERS).tolist())])
    assert close.float().mean() >= min_close, float(close.float().mean())


def check_compaction(ts, monkeypatch, algorithm: str, settings: dict, selection: str,
                     dtype: torch.dtype, device: str = "cpu", h_q: int = 6, h_kv: int = 3,
                     d: int = 16) -> None:
    """A whole compaction with the kernel's scores keeps the same entries as with the
    rule's, so every value of the pool ends the same."""
    rule = _rule(algorithm, selection=selection, **settings)
    args = ([3, 0, 2, 1], list(LENS), [5, 2, 0, 7], list(PROTECTED))
    want = _pool(h_q, h_kv, d, dtype, device)
    compaction.compact(want, rule, *args, fused=False)
    got = _pool(h_q, h_kv, d, dtype, device)
    ran = []
    scorer = SimpleNamespace(**{name: lambda *a, name=name: ran.append(name)
                                or getattr(ts, name)(*a) for name in ("scores", "keep")})
    monkeypatch.setattr(compaction, "fused_scorer", lambda pool, rule, sequences, entries: scorer)
    compaction.compact(got, rule, *args)
    # per head the kernel selects too; per layer the rule sums its scores over the heads
    assert ran == ["keep" if selection == "per_head" else "scores"]
    assert not torch.equal(got.k, _pool(h_q, h_kv, d, dtype, device).k)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def check_keep(ts, algorithm: str, settings: dict, h_q: int, h_kv: int, d: int,
               dtype: torch.dtype, device: str = "cpu") -> None:
    """The kernel's per-head selection keeps what select_batch keeps from the same keys
    and queries, protected prompts excluded."""
    pool, rule = _pool(h_q, h_kv, d, dtype, device), _rule(algorithm, **settings)
    rows, lens = torch.tensor([3, 0, 2, 1], device=device), torch.tensor(LENS, device=device)
    first = torch.tensor(PROTECTED, device=device)
    lmax = max(LENS)
    got = ts.keep(pool.k, pool.q_ring, pool.page_table, PS, rows, lens, first, lmax,
                  rule.cfg, algorithm == "rkv")
    keys = compaction._gather_keys(pool, rows, lmax).view(-1, h_kv, lmax, d)
    queries = pool.ring_queries(rows, torch.tensor([5, 2, 0, 7], device=device))
    want = rule.select_batch(keys, queries.view(-1, h_q, W, d), lens.repeat_interleave(LAYERS),
                             protected=first.repeat_interleave(LAYERS))
    assert got.shape == want.shape == (len(LENS) * LAYERS, h_kv, rule.budget)
    assert torch.equal(got, want)


@pytest.mark.parametrize("algorithm,settings", RULES)
@pytest.mark.parametrize("h_q,h_kv,d,dtype", [(*HEADS[0], torch.float32),
                                              (*HEADS[1], torch.float32),
                                              (*HEADS[1], torch.bfloat16)])
def test_scores_match_score_batch(ts, algorithm, settings, h_q, h_kv, d, dtype):
    """bfloat16 keys: R-KV's similarities rounded to bfloat16 and compared with the
    threshold in bfloat16 (0.3 is 0.30078125 there), as the rule's own path compares."""
    check_scores(ts, algorithm, settings, h_q, h_kv, d, dtype)


@pytest.mark.parametrize("algorithm,settings", RULES[1:3])
@pytest.mark.parametrize("h_q,h_kv,d,dtype", [(*HEADS[0], torch.float32),
                                              (*HEADS[1], torch.bfloat16)])
def test_keep_matches_select_batch(ts, algorithm, settings, h_q, h_kv, d, dtype):
    check_keep(ts, algorithm, settings, h_q, h_kv, d, dtype)


@pytest.mark.parametrize("algorithm,settings", [RULES[0], RULES[2]])
def test_keep_at_tiles_smaller_than_every_cache(ts, monkeypatch, algorithm, settings):
    """Tiles of 16 entries: every pass over a cache of 37-70 entries takes 3-5 steps, the
    search runs in the scoring program or as its own launch of one program per block of
    entries, and the ranking compares blocks of scores with each other. (SnapKV max-pools its scores into ties,
    which top-k breaks in no set order: averaged here.)"""
    for split in (False, True):
        tiles = (16, 16, 16, 4, split)
        monkeypatch.setattr(ts, "_TILES", {False: tiles, True: tiles})
        check_keep(ts, algorithm, settings, *HEADS[1], torch.float32)


@pytest.mark.parametrize("algorithm,settings,selection,dtype", [
    ("rkv", {}, "per_head", torch.float32), ("rkv", {}, "per_layer", torch.float32),
    ("rkv", dict(sim_threshold=0.3), "per_head", torch.bfloat16),
    ("snapkv", dict(pooling="avg"), "per_head", torch.float32),
    ("snapkv", {}, "per_layer", torch.bfloat16)])
def test_compaction_matches_the_rule_path(ts, monkeypatch, algorithm, settings, selection,
                                          dtype):
    check_compaction(ts, monkeypatch, algorithm, settings, selection, dtype)


def test_fused_scorer_serves_only_the_shipped_rules():
    class Mine(type(_rule("rkv"))):
        def score_batch(self, keys, queries, lengths):
            return -keys.norm(dim=-1)

    pool = SimpleNamespace(k=torch.zeros(1, 1, 1, 16))
    assert compaction._FUSED[type(_rule("rkv")).score_batch] is True
    assert type(_rule("knorm")).score_batch not in compaction._FUSED
    assert Mine.score_batch not in compaction._FUSED
    assert compaction.fused_scorer(pool, _rule("rkv"), 1, 1) is None  # CPU: the rule's path


def test_fused_rkv_serves_only_events_where_it_measured_faster(monkeypatch):
    """R-KV's fused scoring only for events of up to 400k sequences x entries^1.5 (its
    redundancy grows faster with the cache than the rule's path; slower above on an
    H200): 24 sequences at 640 entries, 69 at 320 and 119 at 224, not 25, 71 and 120;
    SnapKV's at any size."""
    kernel = object()
    monkeypatch.setattr(compaction, "triton_module", lambda name, like: kernel)
    pool = SimpleNamespace(k=torch.zeros(1, 1, 1, 16))
    rkv = _rule("rkv")
    for sequences, entries in [(24, 640), (69, 320), (119, 224)]:
        assert compaction.fused_scorer(pool, rkv, sequences, entries) is kernel
    for sequences, entries in [(25, 640), (71, 320), (120, 224)]:
        assert compaction.fused_scorer(pool, rkv, sequences, entries) is None
    assert compaction.fused_scorer(pool, _rule("snapkv"), 4096, 4096) is kernel
