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


def test_can_admit_mirrors_schedule_prefill():
    """can_admit is what the overlapped decode asks before launching ahead: it must say
    True exactly when schedule_prefill would start a chunk."""
    allocator = PageAllocator(num_pages=6, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=2, max_prefill_tokens=64)
    a, b, c = (Sequence(i, i, 0, list(range(n)), n, seed=0) for i, n in enumerate((8, 9, 4)))
    assert not sched.can_admit()  # nothing waits
    for seq in (a, b, c):
        sched.add(seq)
    assert sched.can_admit()
    chunks, _ = sched.schedule_prefill()  # a (2 pages) and b (3 pages, 1 left for a)
    assert [s for s, _ in chunks] == [a, b]
    for seq, n in chunks:
        seq.cache_len = seq.num_computed = n
        sched.finish_prefill(seq)
    assert not sched.free_slots and not sched.can_admit()  # c waits for a slot
    assert sched.schedule_prefill() == ([], [])
    sched.finish(a, "stop")  # a slot and 2 pages come back: c's 4 tokens need 1 + 1 reserve
    assert sched.can_admit()
    assert [s for s, _ in sched.schedule_prefill()[0]] == [c]
