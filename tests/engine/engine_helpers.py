"""Helpers for engine tests: a byte-level tokenizer, the single-sequence greedy oracle, a step-until-idle loop."""
from __future__ import annotations

import torch

from mimw.engine.engine import Engine
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment


class ByteTokenizer:
    """UTF-8 bytes as token ids; 0-2 are special (2 = EOS) and decode to nothing. Multi-byte characters span
    several tokens, which is what the incremental detokenizer must handle."""

    eos_token_ids = (2,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i > 2).decode("utf-8", errors="replace")


class IdTokenizer:
    """Token ids as text (" 17 4093 ..."): any vocabulary, no special tokens (random-weight models emit ids a byte
    tokenizer cannot decode)."""

    eos_token_ids = ()

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return "".join(f" {i}" for i in ids)


def greedy_alone(weights, prompt: list[int], n: int, kv_dtype=None) -> list[int]:
    """The oracle: ReferenceDecoder on one sequence with contiguous pages, whole prompt at once (KV in
    ``kv_dtype``, default the weights' dtype)."""
    spec = weights.spec
    cache = PagedKVCache(KVLayout.for_spec(spec, 16, 64, kv_dtype or weights.dtype))
    dec = ReferenceDecoder(weights)
    table = tuple(range(64))
    toks, out = list(prompt), []
    logits = dec.forward(torch.tensor(toks), [Segment(table, 0, len(toks))], cache)
    for _ in range(n):
        t = int(torch.argmax(logits[-1]))
        out.append(t)
        logits = dec.forward(torch.tensor([t]), [Segment(table, len(toks), 1)], cache)
        toks.append(t)
    return out


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; returns every event per request id."""
    events: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return events
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("engine did not finish")
