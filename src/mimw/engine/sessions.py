"""SessionTable: the live agent sessions, what each retains, and when it stops retaining it.

A request may name a session (``session_id``). When one of its requests finishes, the session retains that
request's context: the hashes of its full KV pages (prompt and output), pinned in the ``Retention`` so that every
tier evicts them after pages of no live session. The next turn of the session - the same context plus new
tokens - then finds its prefix cached.

Lifecycle of an id:
  * unknown -> live: the first request naming it (``begin``). A table at ``max_sessions`` first closes its least
    recently used idle session.
  * live -> gone: ``ttl_s`` seconds after its last request finished with none in flight (``expire``), or
    ``close`` (an explicit close: its pins are dropped, so its pages become ordinary cached pages).
  * A closed id is remembered for ``ttl_s`` seconds: a request naming it in that window runs without retention
    (``begin`` returns False) instead of reopening it. An expired id is simply unknown again.
Unknown and closed ids are never errors. Not thread-safe: the engine thread owns it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..kv.retention import Retention

MAX_SESSION_ID_CHARS = 256


@dataclass
class _Session:
    hashes: tuple[bytes, ...] = ()
    last_used: float = 0.0
    in_flight: int = 0


@dataclass
class SessionTable:
    retention: Retention
    ttl_s: float = 300.0
    max_sessions: int = 4096
    _live: OrderedDict[str, _Session] = field(default_factory=OrderedDict)  # least recently used first
    _closed: OrderedDict[str, float] = field(default_factory=OrderedDict)  # id -> when it was closed

    def __post_init__(self) -> None:
        if self.ttl_s < 0:
            raise ValueError(f"session ttl must be >= 0 seconds, got {self.ttl_s}")
        if self.max_sessions <= 0:
            raise ValueError(f"max_sessions must be positive, got {self.max_sessions}")

    @property
    def num_live(self) -> int:
        return len(self._live)

    def is_live(self, sid: str) -> bool:
        return sid in self._live

    def retained(self, sid: str) -> tuple[bytes, ...]:
        s = self._live.get(sid)
        return s.hashes if s else ()

    def begin(self, sid: str, now: float) -> bool:
        """A request of ``sid`` starts. False when the id was closed recently: the request runs without retention."""
        self._forget_closed(now)
        if sid in self._closed:
            return False
        s = self._live.get(sid)
        if s is None:
            if len(self._live) >= self.max_sessions:
                self._close_lru_idle(now)
            s = self._live[sid] = _Session()
        s.in_flight += 1
        s.last_used = now
        self._live.move_to_end(sid)
        return True

    def end(self, sid: str, hashes: tuple[bytes, ...] | None, now: float) -> None:
        """A request of ``sid`` (begun with True) finished; the session now retains ``hashes`` (None: keep what it
        retained, e.g. after an aborted turn). Call it before the request's pages are released."""
        s = self._live.get(sid)
        if s is None:  # closed (or evicted from a full table) while the request ran
            return
        s.in_flight -= 1
        s.last_used = now
        self._live.move_to_end(sid)
        if hashes is not None and hashes != s.hashes:
            self.retention.pin(hashes)  # pin the new set first: pages in both never change class
            self.retention.unpin(s.hashes)
            s.hashes = hashes

    def close(self, sid: str, now: float) -> bool:
        """Stop retaining ``sid``'s pages now (they stay cached as ordinary pages). False if it was not live."""
        s = self._live.pop(sid, None)
        if s is None:
            return False
        self.retention.unpin(s.hashes)
        self._closed[sid] = now
        self._closed.move_to_end(sid)
        while len(self._closed) > self.max_sessions:
            self._closed.popitem(last=False)
        return True

    def expire(self, now: float) -> list[str]:
        """Drop idle sessions whose last request ended more than ``ttl_s`` ago; returns their ids."""
        gone = []
        for sid, s in self._live.items():  # least recently used first: stop at the first one still fresh
            if now - s.last_used <= self.ttl_s:
                break
            if s.in_flight == 0:
                gone.append(sid)
        for sid in gone:
            self.retention.unpin(self._live.pop(sid).hashes)
        self._forget_closed(now)
        return gone

    def _close_lru_idle(self, now: float) -> None:
        for sid, s in self._live.items():
            if s.in_flight == 0:
                self.close(sid, now)
                self._closed.pop(sid, None)  # pushed out, not closed by the client: it may come back
                return

    def _forget_closed(self, now: float) -> None:
        while self._closed and now - next(iter(self._closed.values())) > self.ttl_s:
            self._closed.popitem(last=False)
