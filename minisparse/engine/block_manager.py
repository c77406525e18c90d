"""The page allocator's old module and name (see page_allocator.py)."""
from minisparse.engine.page_allocator import PageAllocator as BlockManager

__all__ = ["BlockManager"]
