"""Scheduler bookkeeping without a model: admission, prompt sharing, a step's books
(advance, postprocess) and pages after a compaction."""
from __future__ import annotations

import pytest

from minisparse.engine.page_allocator import PageAllocator
from minisparse.engine.scheduler import Scheduler
from minisparse.engine.sequence import Sequence


def test_compacted_returns_pages_past_the_budget_and_counts_the_eviction():
    allocator = PageAllocator(num_pages=10, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=2, max_prefill_tokens=64, budget=6)
    seq = Sequence(0, 0, 0, list(range(14)), 14, seed=0)
    sched.add(seq)
    chunks = sched.schedule_prefill()
    assert chunks == [(seq, 14)]
    sched.advance(chunks)
    assert seq.cache_len == seq.num_computed == 14 and seq in sched.running
    owned = list(seq.pages)
    assert len(owned) == 4 and allocator.num_free == 6
    sched.compacted([seq])
    assert seq.pages == owned[:2] and allocator.num_free == 8
    assert set(owned[2:]) <= set(allocator.free)  # the released pages are free again
    assert (seq.cache_len, seq.evicted_tokens, seq.num_compressions) == (6, 8, 1)
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
    chunks = sched.schedule_prefill()  # a (2 pages) and b (3 pages, 1 left for a)
    assert [s for s, _ in chunks] == [a, b]
    sched.advance(chunks)
    assert not sched.free_slots and not sched.can_admit()  # c waits for a slot
    assert sched.schedule_prefill() == []
    sched.finish(a, "stop")  # a slot and 2 pages come back: c's 4 tokens need 1 + 1 reserve
    assert sched.can_admit()
    assert [s for s, _ in sched.schedule_prefill()] == [c]


def test_a_sequence_that_never_fits_is_finished_as_abort_by_the_scheduler():
    """A prompt longer than the whole pool prefills what fits alone; with the pool full
    and its prompt unfinished it is finished "abort" inside schedule_prefill (slot and
    pages back, counted as finished) and the next in the queue starts in the same call."""
    allocator = PageAllocator(num_pages=2, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=2, max_prefill_tokens=64)
    huge = Sequence(0, 0, 0, list(range(20)), 20, seed=0)
    small = Sequence(1, 1, 0, list(range(5)), 5, seed=0)
    sched.add(huge)
    sched.add(small)
    chunks = sched.schedule_prefill()
    assert chunks == [(huge, 8)] and allocator.num_free == 0  # all the pool holds
    sched.advance(chunks)
    chunks = sched.schedule_prefill()
    assert chunks == [(small, 5)]
    assert huge.finish_reason == "abort" and huge.pages == [] and huge.slot == -1
    assert sched.num_finished == 1 and list(sched.waiting) == [small]


def test_a_page_is_free_once_its_last_holder_releases_it():
    allocator = PageAllocator(num_pages=4, page_size=4)
    pages = allocator.allocate(2)
    assert allocator.share(pages[:1]) == pages[:1] and allocator.refs[pages[0]] == 2
    allocator.release(pages)
    assert allocator.num_free == 3 and pages[0] not in allocator.free
    allocator.release(pages[:1])
    assert allocator.num_free == 4
    with pytest.raises(RuntimeError, match="released more often than held"):
        allocator.release(pages[:1])
    with pytest.raises(RuntimeError, match="cannot be shared"):
        allocator.share(pages[:1])


def _siblings(sched, prompt_len: int, n: int) -> list[Sequence]:
    seqs = [Sequence(j, 0, j, list(range(prompt_len)), prompt_len, seed=j) for j in range(n)]
    for seq in seqs:
        sched.add(seq)
    return seqs


def _prefilled(sched, chunks) -> None:
    """A prefill step's forward, as far as the scheduler sees it."""
    sched.advance(chunks)


def test_dense_siblings_wait_one_step_then_hold_the_prompt_pages():
    allocator = PageAllocator(num_pages=20, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=4, max_prefill_tokens=64, share="pages")
    a, b, c = _siblings(sched, 14, 3)
    chunks = sched.schedule_prefill()
    assert chunks == [(a, 14)]  # b and c would find nothing computed yet
    _prefilled(sched, chunks)
    chunks = sched.schedule_prefill()
    # (14 - 1) // 4 = 3 full pages shared; the last prompt token's page is each one's own
    assert chunks == [(b, 2), (c, 2)] and not sched.take_copies()
    assert b.pages[:3] == c.pages[:3] == a.pages[:3] and len({a.pages[3], b.pages[3],
                                                              c.pages[3]}) == 3
    assert [allocator.refs[p] for p in a.pages] == [3, 3, 3, 1]
    assert allocator.num_used == 6 and sched.shared_tokens == 24
    _prefilled(sched, chunks)
    sched.finish(a, "stop")
    assert allocator.num_used == 5  # a's own page only
    sched.finish(b, "stop")
    sched.finish(c, "stop")
    assert allocator.num_free == 20 and not any(allocator.refs)


def test_no_partial_prefill_starts_behind_a_waiting_sibling():
    """A partially prefilled sequence must stay the queue's head (preemption puts the
    preempted behind it); a sibling waiting one step would stand in front of it."""
    allocator = PageAllocator(num_pages=40, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=4, max_prefill_tokens=20, share="pages")
    a, b = _siblings(sched, 14, 2)
    c = Sequence(2, 1, 0, list(range(30)), 30, seed=0)
    sched.add(c)
    assert sched.schedule_prefill() == [(a, 14)]  # b waits; c would be cut to 6 of 30
    _prefilled(sched, [(a, 14)])
    chunks = sched.schedule_prefill()
    assert chunks == [(b, 2), (c, 18)]
    _prefilled(sched, chunks)
    assert list(sched.waiting) == [c]  # partial, at the head


@pytest.mark.parametrize("max_prefill_tokens, first_step", [(100, [40, 24, 6]),
                                                             (160, [40, 24, 6, 5])])
def test_a_step_stops_before_its_padded_query_grid_doubles(max_prefill_tokens, first_step):
    """2 x 40 <= 2 x 64 and 3 x 40 <= 2 x 70, but 4 x 40 > 2 x 75: tiny waits, unless
    the grid of 160 rows fits max_prefill_tokens rows."""
    allocator = PageAllocator(num_pages=100, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=8, max_prefill_tokens=max_prefill_tokens)
    for i, n in enumerate((40, 24, 6, 5)):
        sched.add(Sequence(i, i, 0, list(range(n)), n, seed=0))
    assert [n for _, n in sched.schedule_prefill()] == first_step


def test_compressed_siblings_copy_the_prompt_pages_and_keep_the_window():
    allocator = PageAllocator(num_pages=20, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=4, max_prefill_tokens=64, share="copy", window=4)
    a, b = _siblings(sched, 14, 2)
    _prefilled(sched, sched.schedule_prefill())
    chunks = sched.schedule_prefill()
    # (14 - 4) // 4 = 2 pages: the last 4 prompt tokens' queries go to b's own ring rows
    assert chunks == [(b, 6)] and b.num_computed == 8
    assert sched.take_copies() == [(a.pages[:2], b.pages[:2])]
    assert not set(a.pages) & set(b.pages) and allocator.num_used == 8


def test_a_compacted_sibling_is_no_source():
    allocator = PageAllocator(num_pages=20, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=4, max_prefill_tokens=64, share="copy", window=4,
                      budget=8)
    a, b = _siblings(sched, 14, 2)
    _prefilled(sched, sched.schedule_prefill())
    sched.compacted([a])  # a's pages now hold its kept entries, not the prompt
    assert sched.schedule_prefill() == [(b, 14)] and not sched.take_copies()


def test_under_keep_prompt_a_compacted_sibling_lends_its_prompt_pages():
    """Compaction packs past the prompt under keep_prompt, so a compacted sibling still
    holds the prompt in order: a later sample holds its pages (no copy), and they outlive
    the lender's compaction and its end."""
    allocator = PageAllocator(num_pages=20, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=4, max_prefill_tokens=64, share="pages", window=4,
                      budget=8, keep_prompt=True)
    a, b = _siblings(sched, 14, 2)
    chunks = sched.schedule_prefill()
    assert chunks == [(a, 14)]  # b waits: nothing of a's was computed yet
    _prefilled(sched, chunks)
    sched._grow(a, 26)  # a decodes 12 tokens: 26 entries on 7 pages
    a.cache_len = a.num_computed = 26
    sched.compacted([a])  # the prompt (14) + 8 kept: 22 entries on 6 pages
    assert a.num_compressions == 1 and len(a.pages) == 6 and a.evicted_tokens == 4
    chunks = sched.schedule_prefill()
    assert chunks == [(b, 6)] and not sched.take_copies()  # (14 - 4) // 4 = 2 pages held
    assert b.pages[:2] == a.pages[:2]
    assert [allocator.refs[p] for p in a.pages] == [2, 2, 1, 1, 1, 1]
    sched.finish(a, "stop")
    assert [allocator.refs[p] for p in b.pages[:2]] == [1, 1]
    sched.finish(b, "stop")
    assert allocator.num_free == 20 and not any(allocator.refs)


def test_a_sibling_that_does_not_fit_gives_the_shared_pages_back():
    allocator = PageAllocator(num_pages=5, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=4, max_prefill_tokens=64, share="pages")
    a, b = _siblings(sched, 14, 2)
    _prefilled(sched, sched.schedule_prefill())
    # one page is free and a (running) keeps it for its next token: b's tail cannot start
    assert sched.schedule_prefill() == []
    assert b.pages == [] and b.num_computed == b.cache_len == 0 and b in sched.waiting
    assert [allocator.refs[p] for p in a.pages] == [1, 1, 1, 1]


def test_postprocess_appends_finishes_and_takes_back_compacted_pages():
    """Three steps by hand: a prefill where b reaches its length, a decode step after which
    a's cache was compacted to the budget, and a decode step where a samples a stop token
    (plus the row a stopped sequence runs once more in an overlapped step)."""
    allocator = PageAllocator(num_pages=10, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=2, max_prefill_tokens=64, budget=4)
    a = Sequence(0, 0, 0, list(range(6)), 6, seed=0, stop_ids=frozenset({7}), max_tokens=100)
    b = Sequence(1, 1, 0, list(range(5)), 5, seed=1, stop_ids=frozenset({7}), max_tokens=6)
    sched.add(a)
    sched.add(b)
    chunks = sched.schedule_prefill()
    sched.advance(chunks)
    assert sched.running == [a, b] and allocator.num_free == 6  # 2 pages each
    sched.postprocess([a, b], [9, 9], [-0.5, -1.0], [6, 5])
    assert (b.finish_reason, b.token_ids[-1], b.slot, b.pages) == ("length", 9, -1, [])
    assert a.finish_reason is None and a.token_ids[-1] == 9 and a.logprobs == [-0.5]
    assert sched.running == [a] and allocator.num_free == 8 and sched.num_finished == 1
    assert sched.peak_cached_tokens == 11 and (a.peak_cache, b.peak_cache) == (6, 5)

    assert sched.schedule_decode() == [a]  # entry 6 is on a's second page: none added
    sched.advance([(a, 1)])
    assert (a.num_computed, a.cache_len) == (7, 7)
    sched.postprocess([a], [11], [-0.25], [7], compacted=[a])  # 7 entries -> 4: one page
    assert a.token_ids[-2:] == [9, 11] and a.logprobs == [-0.5, -0.25]
    assert (a.cache_len, a.num_computed) == (4, 7)
    assert (a.evicted_tokens, a.num_compressions, a.peak_cache) == (3, 1, 7)
    assert len(a.pages) == 1 and allocator.num_free == 9

    assert sched.schedule_decode() == [a] and allocator.num_free == 8  # entry 4: a page
    sched.advance([(a, 1)])
    sched.postprocess([a], [7], [-2.0], [5])
    assert (a.finish_reason, a.token_ids[-1], a.peak_cache) == ("stop", 7, 7)
    assert allocator.num_free == 10 and sched.num_finished == 2 and sched.done
    sched.postprocess([a], [3], [-1.0], [6])  # its row in an overlapped step: dropped
    assert a.token_ids[6:] == [9, 11, 7] and a.logprobs == [-0.5, -0.25, -2.0]


def test_while_sequences_decode_a_prefill_waits_for_a_batch_of_free_slots():
    """Stopping the decode for a prefill step pays once admit_batch slots are free, or
    as many as sequences wait: not at every slot a finished answer frees."""
    allocator = PageAllocator(num_pages=40, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=4, max_prefill_tokens=64, admit_batch=2)
    a, b, c, d, e, f, g = (Sequence(i, i, 0, [1, 2, 3], 3, seed=0) for i in range(7))
    for seq in (a, b, c, d, e, f):
        sched.add(seq)
    assert sched.admission_due()  # nothing runs: at once
    sched.advance(sched.schedule_prefill())
    assert sched.running == [a, b, c, d]
    sched.finish(a, "stop")
    assert sched.can_admit() and not sched.admission_due()  # one slot for two waiting
    sched.finish(b, "stop")
    assert sched.admission_due()
    chunks = sched.schedule_prefill()
    assert [s for s, _ in chunks] == [e, f]
    sched.advance(chunks)
    sched.add(g)
    sched.finish(c, "stop")
    assert sched.admission_due()  # the whole queue fits


def test_a_prompt_starts_only_where_its_waiting_siblings_find_slots():
    """A step admits a prompt's first sample only while the free slots also hold its
    siblings, which start from its cached prompt in the next step; otherwise they would
    wait for slots behind other prompts and prefill the prompt again."""
    allocator = PageAllocator(num_pages=40, page_size=4)
    sched = Scheduler(allocator, max_num_seqs=5, max_prefill_tokens=64, share="pages",
                      admit_batch=1)
    a = [Sequence(j, 0, j, list(range(14)), 14, seed=j) for j in range(3)]
    b = [Sequence(3 + j, 1, j, list(range(10)), 10, seed=j) for j in range(3)]
    for seq in a + b:
        sched.add(seq)
    assert sched.schedule_prefill() == [(a[0], 14)]  # b[0] would leave b's siblings 1 slot
    sched.advance([(a[0], 14)])
    assert sched.admission_due()  # the head starts from a[0]'s prompt
    chunks = sched.schedule_prefill()
    assert chunks == [(a[1], 2), (a[2], 2)]
    sched.advance(chunks)
    assert sched.can_admit() and not sched.admission_due()  # b's three need three slots
    assert sched.schedule_prefill() == []
    sched.finish(a[1], "stop")
    assert sched.admission_due()
    assert sched.schedule_prefill() == [(b[0], 10)]
