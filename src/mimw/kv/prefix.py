"""Prefix reuse: full KV pages indexed by a hash chain over their tokens, evicted by an ``EvictionOrder``.

A full page (``page_size`` tokens) at page index i of a sequence is named by

    h_i = blake2b(h_{i-1} || tokens[i*ps : (i+1)*ps])      with h_{-1} = ROOT

so a page's name fixes every token before it, not just its own: two sequences share page i exactly when they
share tokens [0, (i+1)*ps). Only full pages whose K/V have been written are registered; a partial last page is
never shared (a writer would change what the readers see).

The same index serves the GPU pool (driven by ``PageAllocator``'s refcounts) and the host tier's pool
(``mimw.kv.host_tier``). The order of the evictable pages is least-recently-released first, or, with a
``Retention``, pages of no live session before those of a live session (``mimw.kv.retention``).

Invariants:
  * ``_page_of`` and ``_hash_of`` are inverse maps over the registered pages.
  * A registered page is either referenced (its refcount in ``PageAllocator`` is > 0) or parked in ``_order``
    (refcount 0, evictable). ``PageAllocator`` drives ``park``/``unpark``; this class never frees memory itself.
  * ``evict`` forgets a page's hash before handing the page back, so a stale page is never matched again; the
    ``on_evict(hash, page)`` listener (the host tier's offload) runs before the page is handed back.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Sequence

from .retention import EvictionOrder, Retention

ROOT = b"mimw-prefix-v1"


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained name of one full page whose predecessor page is named ``parent`` (ROOT for page 0)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], page_size: int, known: list[bytes] | None = None,
                 num_pages: int | None = None) -> list[bytes]:
    """Hashes of every full page of ``tokens`` (of its first ``num_pages`` pages at most); extends ``known`` (a
    valid prefix of the answer) in place, so that each page is hashed once however often it is asked for."""
    out = known if known is not None else []
    full = len(tokens) // page_size if num_pages is None else min(num_pages, len(tokens) // page_size)
    for i in range(len(out), full):
        parent = out[i - 1] if i else ROOT
        out.append(page_hash(parent, tokens[i * page_size:(i + 1) * page_size]))
    return out


class PrefixCache:
    """Hash -> page index of written full pages, plus the eviction order of the unreferenced ones."""

    def __init__(self, page_size: int, retention: Retention | None = None,
                 on_evict: Callable[[bytes, int], None] | None = None):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.on_evict = on_evict
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._order = EvictionOrder(retention.rank if retention else None)
        if retention is not None:
            retention.subscribe(self._refile)
        self.query_tokens = 0  # prompt tokens looked up (for the hit rate)
        self.hit_tokens = 0  # of which were found cached (in any tier)
        self.host_hit_tokens = 0  # of which came back from the host tier

    # --- lookup / registration ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of ``hashes`` (chain order). Does not take references."""
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def record_lookup(self, query_tokens: int, hit_tokens: int, host_hit_tokens: int = 0) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        self.host_hit_tokens += host_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def insert(self, h: bytes, page: int) -> bool:
        """Register a written, referenced full page under ``h``. False (and nothing changes) when ``h`` is already
        cached in another page or ``page`` already has a name: the first writer wins, duplicates stay private."""
        if h in self._page_of or page in self._hash_of:
            return False
        self._page_of[h] = page
        self._hash_of[page] = h
        return True

    def is_registered(self, page: int) -> bool:
        return page in self._hash_of

    def lookup(self, h: bytes) -> int | None:
        """The page registered under ``h``, if any."""
        return self._page_of.get(h)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    # --- the evictable set (driven by PageAllocator) ----------------------------------------------------------
    def park(self, page: int) -> bool:
        """The page's refcount dropped to 0: keep it evictable if registered (True), else the caller frees it.
        Parking a parked page makes it the most recent of its class."""
        h = self._hash_of.get(page)
        if h is None:
            return False
        self._order.add(page, h)
        return True

    def unpark(self, page: int) -> None:
        """A parked page is referenced again (a prefix hit)."""
        self._order.remove(page)

    def is_parked(self, page: int) -> bool:
        return page in self._order

    def evict(self) -> int | None:
        """Forget the parked page that comes first in the eviction order and return it (None if nothing is
        evictable); ``on_evict`` sees its hash and page first."""
        page = self._order.pop()
        if page is None:
            return None
        h = self._hash_of.pop(page)
        del self._page_of[h]
        if self.on_evict is not None:
            self.on_evict(h, page)
        return page

    def next_evicted(self, n: int) -> list[int]:
        """The parked pages the next ``n`` evictions would take, in that order (nothing changes)."""
        return self._order.first(n)

    @property
    def order_version(self) -> int:
        """Changes whenever the evictable set or its order does (``EvictionOrder.version``)."""
        return self._order.version

    def _refile(self, h: bytes) -> None:
        page = self._page_of.get(h)
        if page is not None:
            self._order.refile(page)

    @property
    def num_parked(self) -> int:
        return len(self._order)

    @property
    def num_registered(self) -> int:
        return len(self._hash_of)
