"""PageAllocator: reference-counted page ids for the paged KV pool of ``mimw.kv.pages``.

Every page id in [0, num_pages) is in exactly one of three states:
  * free     - on the free list, holds nothing useful;
  * in use   - refcount > 0: in the block table of that many live sequences (a shared prefix page has several);
  * parked   - refcount 0 but registered in the ``PrefixCache``: holds a reusable full page, evictable (LRU).

Invariants:
  * ``allocate`` returns pages with refcount 1, taking free pages first and evicting parked pages (oldest release
    first) only when the free list is empty; it raises ``OutOfPages`` and changes nothing if it cannot give all n.
  * ``num_available`` (free + parked) is exactly how many pages ``allocate`` can give right now.
  * ``release`` of a page whose refcount would go negative is a bug and raises (double free).
Not thread-safe: the engine thread owns it.
"""
from __future__ import annotations

from typing import Iterable

from .prefix import PrefixCache


class OutOfPages(RuntimeError):
    """Not enough free or evictable pages; the scheduler handles this by waiting or preempting."""


class PageAllocator:
    def __init__(self, num_pages: int, prefix: PrefixCache | None = None):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.prefix = prefix
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._ref = [0] * num_pages

    # --- queries ------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_parked(self) -> int:
        return self.prefix.num_parked if self.prefix else 0

    @property
    def num_available(self) -> int:
        return self.num_free + self.num_parked

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self.num_available

    def refcount(self, page: int) -> int:
        return self._ref[page]

    # --- transitions --------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free) and n > self.num_available:
            raise OutOfPages(f"need {n} pages, {self.num_available} available of {self.num_pages}")
        out = []
        for _ in range(n):
            page = self._free.pop() if self._free else self.prefix.evict()  # type: ignore[union-attr]
            assert page is not None and self._ref[page] == 0
            self._ref[page] = 1
            out.append(page)
        return out

    def share(self, pages: Iterable[int]) -> None:
        """Take one more reference on each page (a prefix hit); a parked page leaves the evictable set."""
        for p in pages:
            if self._ref[p] == 0:
                if self.prefix is None or not self.prefix.is_registered(p):
                    raise ValueError(f"page {p} is free; only in-use or cached pages can be shared")
                self.prefix.unpark(p)
            self._ref[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference on each page; at 0 a registered page is parked, any other page is freed."""
        for p in pages:
            if self._ref[p] <= 0:
                raise ValueError(f"page {p} released more often than it was taken (double free)")
            self._ref[p] -= 1
            if self._ref[p] == 0 and not (self.prefix and self.prefix.park(p)):
                self._free.append(p)
