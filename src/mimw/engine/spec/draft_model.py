"""Draft-model drafting: a smaller model with the target's tokenizer proposes tokens autoregressively.

The draft model runs through any ``Backend`` on its own paged KV cache with its own ``PageAllocator``. Per request it
keeps the tokens whose K/V its cache holds (``_Seq.tokens``, positions 0 .. len-1, in ``block_table``).

One ``propose`` call, for the batch:
  1. sync: the longest common prefix of ``_Seq.tokens`` and the request's tokens is kept (rejected drafts fall
     out here: rollback is a shorter length plus releasing the pages past it; their stale K/V is overwritten
     before anything reads it, as positions are written before they are attended to);
  2. catch up: one step over every request's tokens past that prefix (the newly accepted ones; the whole prompt
     the first time), with one row of logits each;
  3. draft: the next token from those logits, then k-1 single-token steps batched over the requests still
     drafting. The K/V of d_1 .. d_{k-1} stay in the cache: when the target accepts them, step 1 keeps them.

Drafts are the draft model's argmax (q a point mass: the output equals plain decoding's for a seed), or with
``sample=True`` and a sampling request, draws from its filtered distribution q (``Draft.probs``), which the
standard acceptance rule needs; the draws use a generator of the request's own, seeded from its seed.

Memory is bounded by the pool: a request that cannot get pages (after evicting the least recently drafted
requests outside this batch) gets no draft this step.
"""
from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ...kv.allocator import PageAllocator
from ...models.reference import Segment
from ..backends.base import Backend
from ..sampling import filtered_probs
from .drafter import NO_DRAFT, Draft, DraftInput

_DRAFT_SEED_SALT = 0x5EED_D4AF7


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class DraftModelDrafter:
    def __init__(self, backend: Backend, num_pages: int, page_size: int = 16, sample: bool = False):
        self.backend = backend
        self.page_size = page_size
        self.sample = sample
        self.cache = backend.make_cache(page_size, num_pages)
        self.alloc = PageAllocator(num_pages)
        self.max_len = min(backend.spec.max_position_embeddings, num_pages * page_size)
        self._seqs: OrderedDict[str, _Seq] = OrderedDict()  # least recently drafted first

    # --- the Drafter protocol ---------------------------------------------------------------------------------
    def propose(self, inputs: Sequence[DraftInput], ks: Sequence[int]) -> list[Draft]:
        batch = [i for i, k in enumerate(ks) if k > 0]
        busy = {inputs[i].request_id for i in batch}
        live = []
        for i in batch:
            x, k = inputs[i], ks[i]
            seq = self._sync(x)
            if self._reserve(x.request_id, seq, len(x.token_ids) + k - 1, busy):
                live.append(i)
        if not live:
            return [NO_DRAFT] * len(inputs)

        # catch up: every token of the request the draft cache does not hold yet, one logits row each
        segs, toks = [], []
        for i in live:
            seq, x = self._seqs[inputs[i].request_id], inputs[i]
            pending = list(x.token_ids[len(seq.tokens):])
            segs.append(Segment(tuple(seq.block_table), len(seq.tokens), len(pending)))
            toks += pending
            seq.tokens += pending
        logits = self.backend.forward(torch.tensor(toks, dtype=torch.long), segs, self.cache)  # [len(live), V]

        drafted: dict[int, list[int]] = {i: [] for i in live}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        rows = list(live)
        for r in range(max(ks[i] for i in live)):
            for row, i in enumerate(rows):
                tok, q = self._pick(logits[row], inputs[i])
                drafted[i].append(tok)
                if q is not None:
                    qs[i].append(q)
            rows = [i for i in rows if len(drafted[i]) < ks[i]]
            if not rows:
                break
            segs, toks = [], []
            for i in rows:  # run the token just drafted to draft the one after it
                seq = self._seqs[inputs[i].request_id]
                segs.append(Segment(tuple(seq.block_table), len(seq.tokens), 1))
                toks.append(drafted[i][-1])
                seq.tokens.append(drafted[i][-1])
            logits = self.backend.forward(torch.tensor(toks, dtype=torch.long), segs, self.cache)

        out = [NO_DRAFT] * len(inputs)
        for i in live:
            probs = torch.stack(qs[i]) if qs[i] else None
            out[i] = Draft(tuple(drafted[i]), probs)
        return out

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        pass  # the next propose syncs to the accepted tokens

    def finish(self, x: DraftInput) -> None:
        seq = self._seqs.pop(x.request_id, None)
        if seq is not None:
            self.alloc.release(seq.block_table)

    # --- state --------------------------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def cached_tokens(self, request_id: str) -> list[int]:
        """Tokens whose K/V the draft cache holds for this request (for tests)."""
        seq = self._seqs.get(request_id)
        return list(seq.tokens) if seq else []

    def _sync(self, x: DraftInput) -> _Seq:
        seq = self._seqs.get(x.request_id)
        if seq is None:
            seq = self._seqs[x.request_id] = _Seq(generator=self._generator(x))
        self._seqs.move_to_end(x.request_id)
        toks = x.token_ids
        n = 0
        limit = min(len(seq.tokens), len(toks) - 1)  # keep >= 1 token to run: its logits give the first draft
        while n < limit and seq.tokens[n] == toks[n]:
            n += 1
        del seq.tokens[n:]
        self._trim(seq, n)
        return seq

    def _trim(self, seq: _Seq, n_tokens: int) -> None:
        keep = -(-n_tokens // self.page_size)
        if len(seq.block_table) > keep:
            self.alloc.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _reserve(self, request_id: str, seq: _Seq, positions: int, busy: set[str]) -> bool:
        """Pages for ``positions`` K/V slots; evicts idle requests' caches if needed. False: no draft this step."""
        if positions > self.max_len:
            return False
        need = -(-positions // self.page_size) - len(seq.block_table)
        for rid in list(self._seqs):
            if need <= self.alloc.num_available:
                break
            if rid not in busy:
                self.alloc.release(self._seqs.pop(rid).block_table)
        if need > self.alloc.num_available:
            return False
        seq.block_table += self.alloc.allocate(max(0, need))
        return True

    def _generator(self, x: DraftInput) -> torch.Generator | None:
        if not self.sample or x.params.greedy:
            return None
        seed = (x.params.seed if x.params.seed is not None else secrets.randbits(63)) ^ _DRAFT_SEED_SALT
        return torch.Generator(device="cpu").manual_seed(seed % (2**64))

    def _pick(self, logits: torch.Tensor, x: DraftInput) -> tuple[int, torch.Tensor | None]:
        gen = self._seqs[x.request_id].generator
        if gen is None:
            return int(torch.argmax(logits)), None
        q = filtered_probs(logits, x.params)
        return int(torch.multinomial(q, 1, generator=gen)), q
