"""Continuous batching over a fixed page pool: admit waiting sequences whenever pages
allow (prefill first, in chunks of at most max_prefill_tokens tokens per step), otherwise
decode every running sequence. When a decode step needs a page and none is free, the
newest running sequence is preempted: its pages are freed and it re-enters the queue to be
recomputed from its tokens (prompt + generated so far) later. At most one sequence is
partially prefilled at a time, and it stays at the head of the queue. A step stops adding
chunks before prefill attention's padded [chunks x longest chunk] query grid would exceed
twice the step's tokens and max_prefill_tokens rows.

The n samples of a prompt share its prefill (`share`): a sample admitted after a sibling
whose cache holds the prompt takes that sibling's leading prompt pages and prefills only
the rest (at least its last token, whose logits it samples from, and the last `window`
prompt tokens, whose queries the compression ring needs). "pages": it holds the same pages
(dense caches never rewrite a full prompt page, so nothing is copied and the memory is paid
once); "copy": it gets its own copy of them (compaction rewrites pages in place, so a
compressed cache cannot share), which saves the prefill's compute but not its memory. A
sample whose sibling is being prefilled in the same step waits one step for it; a prompt
longer than the compression budget, compacted right after its prefill, stays whole until
the waiting siblings have copied it (`prompt_wanted`; the engine compacts it then). A
step admits a prompt's first sample only while the free slots also hold its waiting
siblings, so that they start from its prompt in the next step.

While sequences decode, waiting ones are admitted in batches (`admission_due`): once
`admit_batch` slots are free (or the whole queue fits), not at every slot a finished
answer frees. Each prefill step is an eager forward that stops the decode graphs, and real
answers end one by one (docs/engine.md, "Scheduling and preemption").

With compression (`cache_bound`: the most entries a cache of a given prompt length can
hold before the next compaction frees pages), a sequence is admitted only when the pool
can also hold every running cache grown to its bound, and its own: compressed caches stop
growing there, so once admitted nothing is preempted. Optimistic admission instead filled
the pool with young caches that all outgrew it before their first compaction (1,024 R-KV
samples of the 1.5B in a 16 GiB pool: 2,310 preemptions, 43% of the rollout spent
prefilling again). Dense caches have no such bound and are admitted optimistically.

The scheduler also keeps each step's books: advance() when a step's forward is queued,
postprocess() once its tokens are read (tokens appended, finished sequences released, the
pages of compacted caches past the budget returned).
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

from minisparse.engine.page_allocator import PageAllocator
from minisparse.engine.sequence import Sequence, Status


SHARE_MODES = ("pages", "copy", "none")
# With sequences running, a prefill step waits for 1/ADMIT_SHARE of the slots to be free:
# a decode step of 480 sequences costs about what one of 512 does, and a prefill step of
# a few sequences costs several decode steps.
ADMIT_SHARE = 16


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int,
                 max_prefill_tokens: int, share: str = "none", window: int = 0,
                 budget: int = 0, keep_prompt: bool = False,
                 cache_bound: Callable[[int], int] | None = None,
                 admit_batch: int | None = None) -> None:
        """window, budget: the compression's query window and the cache entries a
        compacted sequence keeps (0 when dense), past its prompt when keep_prompt.
        cache_bound: prompt length -> the most cache entries such a sequence holds (None:
        dense, unbounded). admit_batch: free slots that make a prefill step worth stopping
        the running sequences' decode for (admission_due; None: max_num_seqs /
        ADMIT_SHARE)."""
        if share not in SHARE_MODES:
            raise ValueError(f"share must be one of {SHARE_MODES}, got {share!r}")
        self.allocator = allocator
        self.max_prefill_tokens = max_prefill_tokens
        self.share, self.window, self.budget = share, window, budget
        self.keep_prompt = keep_prompt
        self.cache_bound = cache_bound
        self.admit_batch = max(1, admit_batch or max_num_seqs // ADMIT_SHARE)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.dirty: list[Sequence] = []  # sequences whose page list grew (page-table sync)
        self.siblings: defaultdict[int, list[Sequence]] = defaultdict(list)  # by prompt
        self.copies: list[tuple[list[int], list[int]]] = []  # (from pages, to pages)
        self.preemptions = 0
        self.shared_tokens = 0  # prompt tokens taken from a sibling instead of prefilled
        self.num_finished = 0  # sequences finished by a step (stopped, at length, aborted)
        self.peak_cached_tokens = 0  # the most cache entries held at once, all sequences

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.siblings[seq.prompt_index].append(seq)

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

    def schedule_prefill(self) -> list[tuple[Sequence, int]]:
        """Chunks (seq, n_tokens) to prefill this step. A sequence that cannot fit even in
        an otherwise empty pool is finished here as "abort" (its output says so; its pages
        and slot go back), so the caller has nothing more to do for it."""
        chunks, budget = [], self.max_prefill_tokens
        in_step: set[int] = set()  # prompts being prefilled by this step's chunks
        waiters = False  # samples left waiting for a sibling's prompt (ahead in the queue)
        longest = 0  # the step's longest chunk
        reserved = 0  # free slots kept for the waiting siblings of this step's prompts
        owed = self._owed(self.running)  # pages running caches may still take (bounded)
        for seq in list(self.waiting):
            if budget == 0 or (seq.slot < 0 and len(self.free_slots) <= reserved):
                break
            source = self._take_prompt(seq)
            if source is None and seq.prompt_index in in_step and self._shareable(seq):
                waiters = True  # its sibling's prompt is in the cache after this step
                continue
            if source is None and seq.prompt_index not in in_step and seq.slot < 0:
                need = self._waiting_siblings(seq)
                if (chunks or self.running) and len(self.free_slots) <= reserved + need:
                    break  # its siblings would find no slot beside it
                reserved += need
            n = min(len(seq) - seq.num_computed, budget)
            behind = waiters and n < len(seq) - seq.num_computed  # a partial one must lead
            if behind or _too_ragged(len(chunks), longest, self.max_prefill_tokens - budget, n,
                                     self.max_prefill_tokens):
                self._give_back_prompt(seq, source)
                break
            room = self._room(seq, len(self.running) + len(chunks))
            if (chunks or self.running) and not self._fits_bound(seq, owed):
                self._give_back_prompt(seq, source)
                break
            if n > room:
                if chunks or self.running:
                    self._give_back_prompt(seq, source)
                    break
                n = room  # alone (reserve 0): prefill what fits, abort when nothing does
                if n <= 0:
                    self._give_back_prompt(seq, source)
                    self.waiting.remove(seq)
                    self.finish(seq, "abort")
                    continue
            self._grow(seq, seq.cache_len + n)
            if source is not None:
                self.shared_tokens += seq.num_computed
                if self.share == "copy":
                    self.copies.append((source, seq.pages[:len(source)]))
            chunks.append((seq, n))
            owed += self._owed([seq])
            in_step.add(seq.prompt_index)
            budget, longest = budget - n, max(longest, n)
        return chunks

    def _waiting_siblings(self, seq: Sequence) -> int:
        """Seq's waiting siblings that need a slot and would start from its prompt."""
        return sum(1 for s in self.siblings[seq.prompt_index]
                   if s is not seq and s.status is Status.WAITING and s.slot < 0
                   and self._shareable(s))

    def _shareable(self, seq: Sequence) -> int:
        """How many leading prompt pages seq could take from a sibling (0: none), leaving
        its last token and the last `window` prompt tokens to its own prefill."""
        if self.share == "none" or seq.pages or seq.num_computed:
            return 0
        return max(seq.num_prompt - max(self.window, 1), 0) // self.allocator.page_size

    def _take_prompt(self, seq: Sequence) -> list[int] | None:
        """Start seq from a sibling's cached prompt when one holds it: "pages" takes the
        sibling's leading pages themselves, "copy" records them as the source of seq's first
        pages (copied by the engine before the step's forward). Returns those source pages,
        or None (seq unchanged)."""
        k = self._shareable(seq)
        sib = self._prompt_holder(seq, k)
        if sib is None:
            return None
        tokens = k * self.allocator.page_size
        source = sib.pages[:k]
        if self.share == "pages":
            seq.pages = self.allocator.share(source)
            self.dirty.append(seq)
        seq.num_computed = seq.cache_len = tokens
        return source

    def _prompt_holder(self, seq: Sequence, k: int) -> Sequence | None:
        """A sibling whose cache holds the first k pages of seq's prompt (k > 0)."""
        if not k:
            return None
        tokens = k * self.allocator.page_size
        for sib in self.siblings[seq.prompt_index]:
            # A compacted cache holds the prompt in order only under keep_prompt.
            if (sib is not seq and len(sib.pages) >= k and sib.num_computed >= tokens
                    and (sib.num_compressions == 0 or self.keep_prompt)):
                return sib
        return None

    def prompt_wanted(self, seq: Sequence) -> bool:
        """Whether a waiting sibling of seq could still start from seq's cached prompt
        ("copy" sharing): the engine then holds off the compaction due right after seq's
        prefill (a prompt longer than the budget) until the siblings have copied it."""
        if self.share != "copy":
            return False
        return any(s is not seq and s.status is Status.WAITING and self._shareable(s)
                   for s in self.siblings[seq.prompt_index])

    def _give_back_prompt(self, seq: Sequence, source: list[int] | None) -> None:
        """Undo _take_prompt for a sequence that is not scheduled after all."""
        if source is not None:
            self.allocator.release(seq.pages)
            seq.reset_cache()

    def take_copies(self) -> list[tuple[list[int], list[int]]]:
        """Page copies ("copy" sharing) the next forward needs done first."""
        copies, self.copies = self.copies, []
        return copies

    def _room(self, seq: Sequence, reserve: int) -> int:
        """Cache entries seq can take now while one free page stays for each of `reserve`
        running sequences (so admitting does not force the next decode step to preempt)."""
        ps = self.allocator.page_size
        return (len(seq.pages) + self.allocator.num_free - reserve) * ps - seq.cache_len

    def _bound(self, seq: Sequence) -> int:
        """The most cache entries seq holds (cache_bound set): its compression bound, or
        its whole prompt plus a token while a long prompt waits for its first compaction,
        and never more than its length allows."""
        return min(seq.max_tokens, max(self.cache_bound(seq.num_prompt), seq.num_prompt + 1))

    def _owed(self, seqs: list[Sequence]) -> int:
        """Pages seqs may still take before their caches reach their bound (0 when
        dense)."""
        if self.cache_bound is None:
            return 0
        pages_for = self.allocator.pages_for
        return sum(max(0, pages_for(self._bound(s)) - len(s.pages)) for s in seqs)

    def _fits_bound(self, seq: Sequence, owed: int) -> bool:
        """Whether the pool holds seq's cache at its bound beside the `owed` pages of the
        caches already admitted (always, when dense)."""
        if self.cache_bound is None:
            return True
        return self._owed([seq]) + owed <= self.allocator.num_free

    def can_admit(self) -> bool:
        """Whether schedule_prefill would start a chunk now: the queue's head has a slot
        (or one is free) and, with sequences running, its next chunk fits (with
        compression: and its cache at its bound, beside the running ones at theirs)."""
        if not self.waiting:
            return False
        seq = self.waiting[0]
        if seq.slot < 0 and not self.free_slots:
            return False
        if not self.running:
            return True
        n = min(len(seq) - seq.num_computed, self.max_prefill_tokens)
        return n <= self._room(seq, len(self.running)) and \
            self._fits_bound(seq, self._owed(self.running))

    def admission_due(self) -> bool:
        """Whether to stop decoding for a prefill step now: can_admit, and with sequences
        running, the queue's head holds a slot already (partly prefilled), can start from
        a sibling's cached prompt, or admit_batch slots are free (or as many as sequences
        wait), and enough for the head's waiting siblings beside it."""
        if not self.can_admit():
            return False
        head = self.waiting[0]
        if (not self.running or head.slot >= 0
                or self._prompt_holder(head, self._shareable(head)) is not None):
            return True
        want = max(min(len(self.waiting), self.admit_batch), 1 + self._waiting_siblings(head))
        return len(self.free_slots) >= want

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

    def advance(self, chunks: list[tuple[Sequence, int]]) -> None:
        """A step's forward is queued: each (seq, n) of chunks has n more cache entries (a
        decode step: n = 1). They count from here, not from postprocess, because an
        overlapped decode launches the next step before this one's tokens are read. A
        prefill chunk's entries count toward peak_cache at once (a decode step's once its
        token is read: see postprocess); a sequence whose prompt (or recompute) is now all
        in the cache starts decoding."""
        for seq, n in chunks:
            seq.advance(n)
            if seq.status is Status.WAITING:
                seq.peak_cache = max(seq.peak_cache, seq.cache_len)
                if seq.num_computed == len(seq):
                    self.finish_prefill(seq)

    def postprocess(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float],
                    cache_lens: list[int], compacted: list[Sequence] | None = None,
                    ahead: list[tuple[Sequence, int]] = ()) -> None:
        """After a step whose tokens are read: each of seqs appends its token (cache_lens:
        its cache length at the step; a sequence that stopped at the step before, whose row
        ran once more, has nothing to append), those that sample a stop token or reach
        their length finish, and `compacted`, the sequences whose caches were compacted
        after the step, return their pages past the budget. ahead: (sequence, entries
        evicted) of a compaction already run after the step, before its tokens were read;
        one that stops at the step did not need it, and it is taken off its counts."""
        self._note_peak()
        for seq, token, logprob, cache_len in zip(seqs, tokens, logprobs, cache_lens):
            if seq.finish_reason is not None:
                continue
            reason = seq.stop_reason(token)
            seq.append(token, logprob, cache_len)
            if reason is not None:
                self.finish(seq, reason)
        self.compacted(compacted or [])
        for seq, evicted in ahead:
            if seq.finish_reason is not None:
                seq.discount_compaction(evicted)

    def _note_peak(self) -> None:
        cached = sum(s.cache_len for s in self.running) + sum(s.cache_len for s in self.waiting)
        self.peak_cached_tokens = max(self.peak_cached_tokens, cached)

    def compacted(self, seqs: list[Sequence]) -> list[int]:
        """Each of seqs now holds `budget` cache entries, after its prompt's under
        keep_prompt (compaction packed them first): return the pages past them and count
        the eviction; returns the entries each evicted. The peak of entries held counts
        the caches before."""
        if not seqs:  # postprocess after a step with no event: its peak is noted already
            return []
        self._note_peak()
        evicted = []
        for seq in seqs:
            kept = self.budget + (seq.num_prompt if self.keep_prompt else 0)
            keep = self.allocator.pages_for(kept)
            self.allocator.release(seq.pages[keep:])
            seq.pages = seq.pages[:keep]
            seq.synced_pages = min(seq.synced_pages, keep)
            evicted.append(seq.compacted(kept))
        return evicted

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.status = reason, Status.FINISHED
        self.num_finished += 1
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


def _too_ragged(num_chunks: int, longest: int, tokens: int, n: int, rows: int) -> bool:
    """Whether one more chunk of n tokens would pad a step of num_chunks chunks (tokens in
    all, the longest `longest`) past twice its tokens, and past `rows`, in prefill
    attention's [chunks x longest chunk] query grid: e.g. the short tails of samples
    sharing a prompt next to whole prompts. It waits for the next step instead. A grid of
    up to `rows` (max_prefill_tokens) is let through however padded: each step is a
    forward of the whole model, and at twice the tokens alone the MATH prompts' spread of
    lengths cut a GRPO rollout's first prefill into many (docs/engine.md)."""
    grid = (num_chunks + 1) * max(longest, n)
    return num_chunks > 0 and grid > max(2 * (tokens + n), rows)
