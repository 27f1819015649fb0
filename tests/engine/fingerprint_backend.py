"""A stand-in model for property tests of KV movement: the K/V at position p is a fingerprint of tokens [0, p].

``FingerprintBackend.forward`` reads a segment's whole context back from the paged cache and checks it before
writing anything: every row of every layer and head holds fp(q) in K and token q in V, with

    fp(q) = (31 * fp(q - 1) + token_q + 1) mod MOD,        fp(-1) = 0,   MOD < 2**24 (exact in float32)

so a page that is stale, half-copied, copied to the wrong place or read before its copy arrived fails the step
(the engine turns that into finish_reason "error"). The next token is a function of the last fingerprint, so
``expected`` gives the exact output of any prompt: a request served from cached or restored pages must produce it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from mimw.engine.backends.base import Backend
from mimw.kv.pages import PagedKVCache
from mimw.models.reference import Segment
from mimw.models.spec import ModelSpec

MOD = 16_777_213
FIRST_TOKEN = 3  # 0-2 are special for the tests' byte tokenizer


def step_fp(fp: int, token: int) -> int:
    return (31 * fp + token + 1) % MOD


def next_token(fp: int, vocab: int) -> int:
    return FIRST_TOKEN + fp % (vocab - FIRST_TOKEN)


def fingerprints(tokens: Sequence[int]) -> list[int]:
    out, fp = [], 0
    for t in tokens:
        fp = step_fp(fp, t)
        out.append(fp)
    return out


def expected(prompt: Sequence[int], n: int, vocab: int) -> list[int]:
    """The n tokens the backend generates after ``prompt``."""
    fp = fingerprints(prompt)[-1]
    out = []
    for _ in range(n):
        t = next_token(fp, vocab)
        out.append(t)
        fp = step_fp(fp, t)
    return out


def page_values(cache: PagedKVCache, page: int) -> tuple[list[int], list[int]] | None:
    """(fingerprints, tokens) of the rows of ``page`` if every layer, head and dim agrees, else None."""
    k, v = cache.k[:, page], cache.v[:, page]  # [L, H, PS, hd]
    fk, fv = k[0, 0, :, 0], v[0, 0, :, 0]
    if not (torch.equal(k, fk[None, None, :, None].expand_as(k)) and
            torch.equal(v, fv[None, None, :, None].expand_as(v))):
        return None
    return [int(x) for x in fk], [int(x) for x in fv]


class FingerprintBackend(Backend):
    def __init__(self, spec: ModelSpec):
        self.spec = spec

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        ps = cache.layout.page_size
        out = torch.full((len(segments), self.spec.vocab_size), -1e4, dtype=torch.float32)
        t0 = 0
        for i, s in enumerate(segments):
            fp = self._check_context(cache, s.block_table, s.start)
            for pos, tok in zip(range(s.start, s.start + s.length), tokens[t0:t0 + s.length].tolist()):
                fp = step_fp(fp, tok)
                page, row = s.block_table[pos // ps], pos % ps
                cache.k[:, page, :, row, :] = float(fp)
                cache.v[:, page, :, row, :] = float(tok)
            out[i, next_token(fp, self.spec.vocab_size)] = 0.0
            t0 += s.length
        return out

    @staticmethod
    def _check_context(cache: PagedKVCache, table: Sequence[int], length: int) -> int:
        """Verify positions [0, length) of a sequence; returns fp(length - 1) (0 when empty)."""
        ps = cache.layout.page_size
        fp = 0
        for j in range(-(-length // ps)):
            vals = page_values(cache, table[j])
            if vals is None:
                raise AssertionError(f"page {table[j]} (index {j}) is not uniform across layers/heads")
            for row, (f, tok) in enumerate(zip(*vals)):
                if j * ps + row >= length:
                    break
                fp = step_fp(fp, tok)
                if f != fp:
                    raise AssertionError(f"wrong K/V at position {j * ps + row} (page {table[j]})")
        return fp
