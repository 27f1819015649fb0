"""Prompt lookup (n-gram) drafting: if the last n tokens occurred earlier in the request (prompt or output), propose
what followed them there.

For n from ``max_n`` down to ``min_n`` (adaptive: the longest context that has been seen before wins), look up
the latest earlier position where the request's last n tokens ended, and copy the tokens that followed it. The
copy may run into the current end and continue from the tokens it has just proposed (as an LZ77 copy does), so
a repeating pattern such as ``a b a b`` is proposed as ``a b a b ...`` and not cut at the end of the request.

Each request keeps, for every n, a dict from n-gram to the latest position it ended at, extended incrementally
as the request grows: a step costs O(max_n + k), not a scan of the whole context.
"""
from __future__ import annotations

from typing import Sequence

from .drafter import DraftInput, TokenDrafter


class _Index:
    """n-gram -> latest end position (exclusive) over ends 1..upto of ``tokens``, for every n in [min_n, max_n]."""

    def __init__(self, min_n: int, max_n: int):
        self.tokens: list[int] = []
        self.upto = 0
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def sync(self, token_ids: Sequence[int]) -> bool:
        """Take the request's tokens; False when they are not an extension of what was indexed (start over)."""
        n_old = len(self.tokens)
        if len(token_ids) < n_old or list(token_ids[:n_old]) != self.tokens:
            return False
        self.tokens.extend(token_ids[n_old:])
        return True

    def index_until(self, end: int) -> None:
        toks = self.tokens
        for e in range(self.upto + 1, end + 1):
            for n, table in self.latest.items():
                if e >= n:
                    table[tuple(toks[e - n:e])] = e
        self.upto = max(self.upto, end)


class NgramDrafter(TokenDrafter):
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, _Index] = {}

    def propose_one(self, x: DraftInput, k: int) -> list[int]:
        idx = self._index.get(x.request_id)
        if idx is None or not idx.sync(x.token_ids):
            idx = self._index[x.request_id] = _Index(self.min_n, self.max_n)
            idx.sync(x.token_ids)
        toks = idx.tokens
        end = len(toks)
        idx.index_until(end - 1)  # every end but the current one: the current suffix must match *earlier* text
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            e = idx.latest[n].get(tuple(toks[end - n:]))
            if e is not None:
                return _copy(toks, e, k)
        return []

    def finish(self, x: DraftInput) -> None:
        self._index.pop(x.request_id, None)


def _copy(toks: list[int], start: int, k: int) -> list[int]:
    """k tokens read from ``start`` on, reading past the end from the copy itself (overlapping copy)."""
    out: list[int] = []
    n = len(toks)
    for i in range(k):
        j = start + i
        out.append(toks[j] if j < n else out[j - n])
    return out
