"""The example rule of docs/compression.md ("Write your own rule") runs as printed: its
batched selection, NaN padding included, keeps what a float64 loop of its definition
ranks highest (the newest query's attention, averaged over each KV head's query heads)."""
from __future__ import annotations

import math

import torch

from minisparse.compression import ScoringRule
from minisparse.config.schema import CompressConfig

from . import reference
from .helpers import doc_rule_module, make_inputs


def example_rule() -> type[ScoringRule]:
    namespace: dict = {}
    exec(compile(doc_rule_module(), "docs/compression.md", "exec"), namespace)
    return namespace["MyRule"]


def last_query_scores(keys: torch.Tensor, queries: torch.Tensor, window: int) -> torch.Tensor:
    h_kv, length, dim = keys.shape
    group = queries.shape[0] // h_kv
    older = length - window
    out = torch.zeros(h_kv, older, dtype=torch.float64)
    for h in range(h_kv):
        for g in range(group):
            logits = [float(keys[h, i].double() @ queries[h * group + g, -1].double())
                      / math.sqrt(dim) for i in range(older)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            out[h] += torch.tensor(weights, dtype=torch.float64) / sum(weights) / group
    return out


def test_the_documented_example_rule_selects_by_its_definition():
    rule = example_rule()(CompressConfig(budget=24, window=4))
    lengths = [30, 61, 100]
    keys = torch.full((3, 2, 100, 16), float("nan"))
    rows = [make_inputs(2, 4, n, 4, seed=n) for n in lengths]
    for b, (k, _) in enumerate(rows):
        keys[b, :, :k.shape[1]] = k
    queries = torch.stack([q for _, q in rows])
    kept = rule.select_batch(keys, queries, torch.tensor(lengths))
    for b, ((k, q), n) in enumerate(zip(rows, lengths)):
        ref = last_query_scores(k, q, 4)
        reference.check_selection(kept[b], ref, n, 24, 4, "per_head", atol=1e-6)
        torch.testing.assert_close(rule.score(k, q).double(), ref, rtol=1e-5, atol=1e-7)
