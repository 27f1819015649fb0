"""Retention: which cached pages belong to a live session, and the eviction order that follows from it.

Every tier (GPU pool, host pool) keeps its evictable pages in an ``EvictionOrder``. Under the ``session`` policy a
page whose hash is pinned by a live session (``Retention.pin``) is evicted only after every page that belongs to
no live session; within each of the two classes the least recently parked page goes first. Under the ``lru``
policy the classes are ignored: plain least-recently-parked order (the baseline the trace benchmark compares
against).

Pins count sessions: a hash shared by several sessions (a common system prompt) stays pinned until the last of
them unpins it. When a hash changes class, every tier's order re-files the page that holds it, keeping its
recency.

Invariants:
  * ``EvictionOrder.pop`` returns the live entry with the smallest (class, tick); every entry is returned once.
  * An entry's tick is the value of a per-order counter when it was (re)parked: recency is parking order.
"""
from __future__ import annotations

import bisect
from typing import Callable, Hashable, Iterable

POLICIES = ("session", "lru")


class Retention:
    """Pin counts of page hashes held by live sessions, and the listeners told when a hash changes class."""

    def __init__(self, policy: str = "session"):
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self._pins: dict[bytes, int] = {}
        self._listeners: list[Callable[[bytes], None]] = []

    def subscribe(self, listener: Callable[[bytes], None]) -> None:
        """``listener(h)`` runs whenever ``rank(h)`` changes."""
        self._listeners.append(listener)

    def rank(self, h: bytes | None) -> int:
        """Eviction class of a page named ``h``: 0 is evicted first, 1 (a live session's page) after."""
        return int(self.policy == "session" and h is not None and h in self._pins)

    def is_pinned(self, h: bytes) -> bool:
        return h in self._pins

    def pin(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            n = self._pins.get(h, 0)
            self._pins[h] = n + 1
            if n == 0:
                self._changed(h)

    def unpin(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            n = self._pins[h]  # KeyError: unpinning what was never pinned is a bug
            if n == 1:
                del self._pins[h]
                self._changed(h)
            else:
                self._pins[h] = n - 1

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def _changed(self, h: bytes) -> None:
        if self.policy == "session":
            for f in self._listeners:
                f(h)


class EvictionOrder:
    """The evictable entries of one tier in eviction order: by class, then least recently parked first.

    A key is a page id of the tier; ``rank`` gives its class from its hash (``Retention.rank``). Each class keeps
    (tick, key) pairs in a list sorted by tick. Parking appends (a new tick is the largest); only a re-file (a key
    changing class, keeping its tick) inserts inside a list, by bisection. Removing or re-parking a key leaves its
    old pair in place, stale (``_live`` no longer agrees with it): a walk skips it, ``pop`` drops it, ``first``
    drops those it met, and all are dropped once they outnumber the live pairs. Popped pairs stay in front of a
    list's head until they are half of it. So ``pop`` costs O(1) amortised and ``first(n)`` reads about n pairs
    and changes no order: the host tier asks for the next pages to back up after every step
    (``HostKVTier.backup``), which must not cost a walk of the pool. ``version`` changes whenever the order does
    (a key parked, removed, re-filed to another class or popped), so that a reader of ``first`` can tell that
    nothing moved since its last look."""

    def __init__(self, rank: Callable[[bytes | None], int] | None = None):
        self._rank = rank or (lambda h: 0)
        self._live: dict[Hashable, tuple[int, int, bytes | None]] = {}  # key -> (class, tick, hash)
        self._lists: tuple[list, list] = ([], [])  # per class: (tick, key), ascending ticks, stale pairs included
        self._heads = [0, 0]  # per class: the pairs before it were popped
        self._tick = 0
        self.version = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def add(self, key: Hashable, h: bytes | None) -> None:
        """Park ``key`` (named ``h``) as the most recent entry of its class (re-parking refreshes it)."""
        self._tick += 1
        self.version += 1
        cls = self._rank(h)
        self._live[key] = (cls, self._tick, h)
        self._lists[cls].append((self._tick, key))
        self._compact_if_stale()

    def remove(self, key: Hashable) -> None:
        if self._live.pop(key, None) is not None:
            self.version += 1

    def refile(self, key: Hashable) -> None:
        """Move ``key`` to its hash's current class, keeping its recency (after a pin count crossed zero)."""
        entry = self._live.get(key)
        if entry is None:
            return
        old, tick, h = entry
        cls = self._rank(h)
        if cls == old:
            return
        self.version += 1
        self._live[key] = (cls, tick, h)
        lst, pair = self._lists[cls], (tick, key)
        i = bisect.bisect_left(lst, pair, self._heads[cls])  # ticks are unique but to the same key: no key compare
        if i == len(lst) or lst[i] != pair:  # (its stale pair, if it was filed here before, is live again)
            lst.insert(i, pair)
        self._compact_if_stale()

    def pop(self) -> Hashable | None:
        """Remove and return the entry to evict first, or None when empty."""
        for cls, lst in enumerate(self._lists):
            i = self._heads[cls]
            while i < len(lst):
                tick, key = lst[i]
                i += 1
                if self._is_live(cls, tick, key):
                    del self._live[key]
                    self.version += 1
                    self._advance(cls, i)
                    return key
            self._advance(cls, i)
        return None

    def first(self, n: int) -> list[Hashable]:
        """The next ``n`` keys ``pop`` would return, in that order, without removing them."""
        out: list[Hashable] = []
        for cls, lst in enumerate(self._lists):
            head = i = self._heads[cls]
            kept = []
            while i < len(lst) and len(out) < n:
                tick, key = lst[i]
                i += 1
                if self._is_live(cls, tick, key):
                    out.append(key)
                    kept.append((tick, key))
            if len(kept) < i - head:  # drop the stale pairs met, so that the next walk reads only live ones
                lst[head:i] = kept
            if len(out) == n:
                break
        return out

    # --- internals ---------------------------------------------------------------------------------------------
    def _is_live(self, cls: int, tick: int, key: Hashable) -> bool:
        entry = self._live.get(key)
        return entry is not None and entry[0] == cls and entry[1] == tick

    def _advance(self, cls: int, head: int) -> None:
        """Pairs before ``head`` are consumed; the list sheds them once they are half of it."""
        lst = self._lists[cls]
        if head > 32 and 2 * head > len(lst):
            del lst[:head]
            head = 0
        self._heads[cls] = head

    def _compact_if_stale(self) -> None:
        pairs = len(self._lists[0]) - self._heads[0] + len(self._lists[1]) - self._heads[1]
        if pairs > 2 * len(self._live) + 64:
            lists: tuple[list, list] = ([], [])
            for key, (cls, tick, _) in self._live.items():
                lists[cls].append((tick, key))
            for lst in lists:
                lst.sort()
            self._lists, self._heads = lists, [0, 0]
