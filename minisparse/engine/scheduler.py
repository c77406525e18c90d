"""Continuous batching over a fixed page pool: admit waiting sequences whenever pages
allow (prefill first, in chunks of at most max_prefill_tokens tokens per step), otherwise
decode every running sequence. When a decode step needs a page and none is free, the
newest running sequence is preempted: its pages are freed and it re-enters the queue to be
recomputed from its tokens (prompt + generated so far) later. At most one sequence is
partially prefilled at a time, and it stays at the head of the queue.
"""
from __future__ import annotations

from collections import deque

from minisparse.engine.page_allocator import PageAllocator
from minisparse.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int,
                 max_prefill_tokens: int) -> None:
        self.allocator = allocator
        self.max_prefill_tokens = max_prefill_tokens
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.dirty: list[Sequence] = []  # sequences whose page list grew (page-table sync)
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _grow(self, seq: Sequence, tokens: int) -> None:
        """Give seq enough pages for `tokens` cache entries (and a slot if it has none)."""
        need = self.allocator.pages_for(tokens) - len(seq.pages)
        if need > 0:
            seq.pages += self.allocator.allocate(need)
            self.dirty.append(seq)
        if seq.slot < 0:
            seq.slot = self.free_slots.pop()

    def schedule_prefill(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Chunks (seq, n_tokens) to prefill this step, and sequences that cannot fit even
        in an otherwise empty pool (to be aborted; already removed from the queue)."""
        chunks, aborted, budget = [], [], self.max_prefill_tokens
        for seq in list(self.waiting):
            if budget == 0 or (seq.slot < 0 and not self.free_slots):
                break
            n = min(len(seq) - seq.num_computed, budget)
            room = self._room(seq, len(self.running) + len(chunks))
            if n > room:
                if chunks or self.running:
                    break
                n = room  # alone (reserve 0): prefill what fits, abort when nothing does
                if n <= 0:
                    self.waiting.remove(seq)
                    self.free(seq)
                    aborted.append(seq)
                    continue
            self._grow(seq, seq.cache_len + n)
            chunks.append((seq, n))
            budget -= n
        return chunks, aborted

    def _room(self, seq: Sequence, reserve: int) -> int:
        """Cache entries seq can take now while one free page stays for each of `reserve`
        running sequences (so admitting does not force the next decode step to preempt)."""
        ps = self.allocator.page_size
        return (len(seq.pages) + self.allocator.num_free - reserve) * ps - seq.cache_len

    def can_admit(self) -> bool:
        """Whether schedule_prefill would start a chunk now: the queue's head has a slot
        (or one is free) and, with sequences running, its next chunk fits."""
        if not self.waiting:
            return False
        seq = self.waiting[0]
        if seq.slot < 0 and not self.free_slots:
            return False
        n = min(len(seq) - seq.num_computed, self.max_prefill_tokens)
        return not self.running or n <= self._room(seq, len(self.running))

    def finish_prefill(self, seq: Sequence) -> None:
        """A sequence whose prompt (or recompute) is fully in the cache starts decoding."""
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def schedule_decode(self) -> list[Sequence]:
        """Running sequences that get a cache slot for their next token, oldest first;
        preempts the newest ones when the pool is out of pages."""
        running = self.running
        if self.reserve_next(running):  # common case: no preemption
            return list(running)
        scheduled, queue = [], deque(running)
        while queue:
            seq = queue.popleft()
            need = self.allocator.pages_for(seq.cache_len + 1) - len(seq.pages)
            while need > self.allocator.num_free and queue:
                self.preempt(queue.pop())
            if need > self.allocator.num_free:
                self.preempt(seq)
                continue
            self._grow(seq, seq.cache_len + 1)
            scheduled.append(seq)
        self.running = list(scheduled)
        return scheduled

    def reserve_next(self, seqs: list[Sequence]) -> bool:
        """Pages for one more cache entry of each of seqs when the pool has them all (in
        seqs' order, as schedule_decode allocates); False, allocating nothing, when not."""
        ps = self.allocator.page_size
        grow = [s for s in seqs if s.cache_len >= len(s.pages) * ps]  # needs a page
        if sum(-(-(s.cache_len + 1) // ps) - len(s.pages) for s in grow) > self.allocator.num_free:
            return False
        for seq in grow:
            self._grow(seq, seq.cache_len + 1)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's cache; it goes back to the queue front (behind a partial prefill)."""
        self.free(seq)
        seq.reset_cache()
        at = 1 if self.waiting and self.waiting[0].pages else 0
        self.waiting.insert(at, seq)
        self.preemptions += 1

    def free(self, seq: Sequence) -> None:
        """Return seq's pages and slot (finished, aborted or preempted)."""
        self.allocator.release(seq.pages)
        seq.pages, seq.synced_pages = [], 0
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def compacted(self, seqs: list[Sequence], budget: int) -> None:
        """Each of seqs now holds `budget` cache entries (compaction packed them first):
        return the pages past them and count the eviction."""
        keep = self.allocator.pages_for(budget)
        for seq in seqs:
            self.allocator.release(seq.pages[keep:])
            seq.pages = seq.pages[:keep]
            seq.synced_pages = min(seq.synced_pages, keep)
            seq.evicted_tokens += seq.cache_len - budget
            seq.cache_len, seq.since_compress = budget, 0
            seq.num_compressions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.status = reason, Status.FINISHED
        self.free(seq)
        for i, s in enumerate(self.running):  # by identity (dataclass == compares fields)
            if s is seq:
                del self.running[i]
                break

    def take_dirty(self) -> list[Sequence]:
        """Sequences whose page-table rows need syncing (deduplicated, still holding pages);
        each needs only its pages from seq.synced_pages on written."""
        dirty, self.dirty = self.dirty, []
        return [s for s in {id(s): s for s in dirty}.values() if s.slot >= 0]
