"""Page allocator for the KV pool: a free list of page ids and a reference count per page.
Which pages a sequence owns is its `pages` list; the runner mirrors it into a device page
table. A page can be held by several sequences at once (the n samples of a prompt share its
prompt pages, see Scheduler); it returns to the free list when its last holder releases it.
(It was called BlockManager; that name stays importable from engine/block_manager.py.)"""
from __future__ import annotations

from collections import deque


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.free: deque[int] = deque(range(num_pages))
        self.refs = [0] * num_pages
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KV pool: asked for {n} pages, {len(self.free)} free")
        pages = [self.free.popleft() for _ in range(n)]
        for page in pages:
            self.refs[page] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """One more holder for pages already in use; returns them."""
        for page in pages:
            if self.refs[page] <= 0:
                raise RuntimeError(f"KV pool: page {page} is free, it cannot be shared")
            self.refs[page] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        """Drop one holder of each page; pages nobody holds any more become free."""
        for page in pages:
            if self.refs[page] <= 0:
                raise RuntimeError(f"KV pool: page {page} released more often than held")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)
