"""Prefix reuse: full KV pages indexed by a hash chain over their tokens, evicted least-recently-released first.

A full page (``page_size`` tokens) at page index i of a sequence is named by

    h_i = blake2b(h_{i-1} || tokens[i*ps : (i+1)*ps])      with h_{-1} = ROOT

so a page's name fixes every token before it, not just its own: two sequences share page i exactly when they
share tokens [0, (i+1)*ps). Only full pages whose K/V have been written are registered; a partial last page is
never shared (a writer would change what the readers see).

Invariants:
  * ``_page_of`` and ``_hash_of`` are inverse maps over the registered pages.
  * A registered page is either referenced (its refcount in ``PageAllocator`` is > 0) or parked in ``_lru``
    (refcount 0, evictable). ``PageAllocator`` drives ``park``/``unpark``; this class never frees memory itself.
  * ``evict`` forgets a page's hash before handing the page back, so a stale page is never matched again.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

ROOT = b"mimw-prefix-v1"


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained name of one full page whose predecessor page is named ``parent`` (ROOT for page 0)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], page_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full page of ``tokens``; extends ``known`` (a valid prefix of the answer) in place."""
    out = known if known is not None else []
    for i in range(len(out), len(tokens) // page_size):
        parent = out[i - 1] if i else ROOT
        out.append(page_hash(parent, tokens[i * page_size:(i + 1) * page_size]))
    return out


class PrefixCache:
    """Hash -> page index of written full pages, plus the LRU order of the unreferenced ones."""

    def __init__(self, page_size: int):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.query_tokens = 0  # prompt tokens looked up (for the hit rate)
        self.hit_tokens = 0  # of which were found cached

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

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

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

    # --- the evictable set (driven by PageAllocator) ----------------------------------------------------------
    def park(self, page: int) -> bool:
        """The page's refcount dropped to 0: keep it evictable if registered (True), else the caller frees it."""
        if page not in self._hash_of:
            return False
        self._lru[page] = None
        self._lru.move_to_end(page)
        return True

    def unpark(self, page: int) -> None:
        """A parked page is referenced again (a prefix hit)."""
        self._lru.pop(page, None)

    def evict(self) -> int | None:
        """Forget the least recently released parked page and return it (None if nothing is evictable)."""
        if not self._lru:
            return None
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        return page

    @property
    def num_parked(self) -> int:
        return len(self._lru)

    @property
    def num_registered(self) -> int:
        return len(self._hash_of)
