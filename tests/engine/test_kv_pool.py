"""KVPool's reads that compaction relies on, against element-by-element indexing."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import build, make_engine
from minisparse.config.schema import CompressConfig


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_queries_in_time_order_as_scoring_reads_them(dtype):
    """Row r's last W queries, oldest first (the ring slot after the newest is the
    oldest), for every layer and query head: [rows, layers, H_q, W, D]."""
    cfg = CompressConfig(algorithm="rkv", budget=8, window=4, divide_length=4)
    pool = make_engine(build("qwen2", dtype=dtype), cfg).pool
    g = torch.Generator().manual_seed(0)
    pool.q_ring.copy_(torch.randn(pool.q_ring.shape, generator=g).to(dtype))
    rows, next_pos = torch.tensor([3, 0, 5]), torch.tensor([9, 4, 2])
    got = pool.ring_queries(rows, next_pos)
    layers, _, h_q, d = pool.q_ring.shape
    W = pool.window
    assert got.shape == (3, layers, h_q, W, d)
    for i, (r, p) in enumerate(zip(rows.tolist(), next_pos.tolist())):
        for w in range(W):
            want = pool.q_ring[:, r * W + (p + w) % W]  # [layers, H_q, D]
            assert torch.equal(got[i, :, :, w], want)
