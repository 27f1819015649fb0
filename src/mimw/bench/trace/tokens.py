"""Prompt tokens synthesised from a trace's hash ids: equal (scope, id) -> equal tokens, deterministically.

Block ``id`` of scope ``s`` is ``block_size`` token ids drawn uniformly from [lo, hi) by a generator seeded with
blake2b(seed, s, id); a request's prompt is its blocks' tokens, the last block cut to the input length. Tokens the
ids do not cover (an input longer than its blocks) are drawn from a seed private to the request, so they are
shared with nothing. The same trace and seed give the same prompts in every run and on every machine.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from .format import TraceRequest


def token_range(vocab_size: int) -> tuple[int, int]:
    """Ids to draw from: past the usual special tokens, within the vocabulary."""
    if vocab_size < 1000:
        return 3, vocab_size
    return 100, min(vocab_size, 32000)


class TokenSynth:
    def __init__(self, vocab_size: int, seed: int = 0):
        self.lo, self.hi = token_range(vocab_size)
        self.seed = seed
        self._block = lru_cache(maxsize=1 << 16)(self._make_block)

    def _rng(self, *key: object) -> np.random.Generator:
        h = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(h, "little"))

    def _make_block(self, scope: str, hid: int, size: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self._rng("block", scope, hid, size).integers(self.lo, self.hi, size))

    def prompt(self, r: TraceRequest) -> list[int]:
        out: list[int] = []
        for i, hid in enumerate(r.hash_ids):
            n = r.block_len(i)
            if n == 0:
                break
            out.extend(self._block(r.scope, hid, r.block_size)[:n])
        missing = r.input_length - len(out)
        if missing > 0:
            out.extend(int(t) for t in self._rng("pad", r.scope, r.index).integers(self.lo, self.hi, missing))
        return out
