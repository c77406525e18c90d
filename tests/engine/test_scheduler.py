"""Scheduler bookkeeping without a model: pages after a compaction."""
from __future__ import annotations

from minisparse.engine.page_allocator import PageAllocator
from minisparse.engine.scheduler import Scheduler
from minisparse.engine.sequence import Sequence


def test_compacted_returns_pages_past_the_budget_and_counts_the_eviction():
    allocator = PageAllocator(num_pages=10, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=2, max_prefill_tokens=64)
    seq = Sequence(0, 0, 0, list(range(14)), 14, seed=0)
    sched.add(seq)
    chunks, aborted = sched.schedule_prefill()
    assert chunks == [(seq, 14)] and not aborted
    seq.cache_len = seq.num_computed = 14  # what the engine records after the prefill
    seq.since_compress = 5
    owned = list(seq.pages)
    assert len(owned) == 4 and allocator.num_free == 6
    sched.compacted([seq], budget=6)
    assert seq.pages == owned[:2] and allocator.num_free == 8
    assert set(owned[2:]) <= set(allocator.free)  # the released pages are free again
    assert (seq.cache_len, seq.since_compress, seq.evicted_tokens, seq.num_compressions) == (
        6, 0, 8, 1)
    assert seq.num_computed == 14  # RoPE positions go on from where they were
