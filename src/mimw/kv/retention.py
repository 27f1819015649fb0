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

import heapq
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
    """The evictable entries of one tier, popped by (class, recency): two lazy min-heaps of (tick, key).

    A key is a page id of the tier; ``rank`` gives its class from its hash (``Retention.rank``). Stale heap entries
    (removed or re-filed keys) are skipped when they surface and dropped when the heaps grow past twice the live
    size."""

    def __init__(self, rank: Callable[[bytes | None], int] | None = None):
        self._rank = rank or (lambda h: 0)
        self._live: dict[Hashable, tuple[int, int, bytes | None]] = {}  # key -> (class, tick, hash)
        self._heaps: tuple[list, list] = ([], [])
        self._tick = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def add(self, key: Hashable, h: bytes | None) -> None:
        """Park ``key`` (named ``h``) as the most recent entry of its class (re-parking refreshes it)."""
        self._tick += 1
        self._file(key, self._rank(h), self._tick, h)

    def remove(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def refile(self, key: Hashable) -> None:
        """Move ``key`` to its hash's current class, keeping its recency (after a pin count crossed zero)."""
        entry = self._live.get(key)
        if entry is not None and entry[0] != self._rank(entry[2]):
            self._file(key, self._rank(entry[2]), entry[1], entry[2])

    def pop(self) -> Hashable | None:
        """Remove and return the entry to evict first, or None when empty."""
        key = self._peek_pop()
        if key is not None:
            del self._live[key]
        return key

    def first(self, n: int) -> list[Hashable]:
        """The next ``n`` keys ``pop`` would return, in that order, without removing them."""
        taken = []
        while len(taken) < n:
            key = self._peek_pop()
            if key is None:
                break
            taken.append((key, self._live.pop(key)))  # hidden from the next _peek_pop, put back below
        for key, (cls, tick, h) in taken:
            self._file(key, cls, tick, h)
        return [key for key, _ in taken]

    # --- internals ---------------------------------------------------------------------------------------------
    def _file(self, key: Hashable, cls: int, tick: int, h: bytes | None) -> None:
        self._live[key] = (cls, tick, h)
        heapq.heappush(self._heaps[cls], (tick, key))
        if len(self._heaps[0]) + len(self._heaps[1]) > 2 * len(self._live) + 64:
            self._compact()

    def _peek_pop(self) -> Hashable | None:
        """The live key with the smallest (class, tick), popping stale heap entries on the way (not the key)."""
        for cls, heap in enumerate(self._heaps):
            while heap:
                tick, key = heap[0]
                if self._live.get(key, (None, None))[:2] == (cls, tick):
                    return key
                heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        heaps: tuple[list, list] = ([], [])
        for key, (cls, tick, _) in self._live.items():
            heaps[cls].append((tick, key))
        for hp in heaps:
            heapq.heapify(hp)
        self._heaps = heaps
