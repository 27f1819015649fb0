"""Helpers for speculative-decoding tests: scripted drafters and an engine factory with a speculator."""
from __future__ import annotations

import random

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.spec.config import SpecConfig
from mimw.engine.spec.drafter import Draft, DraftInput, TokenDrafter
from mimw.engine.spec.speculator import Speculator, make_drafter

from engine_helpers import ByteTokenizer


class ScriptedDrafter(TokenDrafter):
    """Proposes the known continuation of each prompt (``script[prompt tuple]``: the plain greedy output), each
    token replaced by a wrong one with probability ``noise``; records what it was asked."""

    def __init__(self, script: dict[tuple[int, ...], list[int]], noise: float = 0.0, seed: int = 0,
                 vocab: int = 256):
        self.script = script
        self.noise = noise
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.asked: list[tuple[str, int]] = []
        self.finished: list[str] = []

    def propose_one(self, x: DraftInput, k: int) -> list[int]:
        self.asked.append((x.request_id, k))
        prompt = tuple(x.token_ids[:x.num_prompt_tokens])
        done = len(x.token_ids) - x.num_prompt_tokens
        true = self.script.get(prompt, [])[done:done + k]
        return [self.rng.randrange(self.vocab) if self.rng.random() < self.noise else t for t in true]

    def finish(self, x: DraftInput) -> None:
        self.finished.append(x.request_id)


class GarbageDrafter(TokenDrafter):
    """Random tokens: nearly every draft is rejected, which exercises rollback."""

    def __init__(self, seed: int = 0, vocab: int = 256):
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose_one(self, x: DraftInput, k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]


class FailingDrafter(TokenDrafter):
    def propose_one(self, x: DraftInput, k: int) -> list[int]:
        raise RuntimeError("drafter bug")


def spec_engine(weights, drafter=None, method: str = "ngram", num_tokens: int = 4, eos=(), **cfg) -> Engine:
    spec_cfg = SpecConfig(method, num_tokens=num_tokens) if method != "draft" else None
    if drafter is None:
        drafter = make_drafter(spec_cfg)
    speculator = Speculator(drafter, spec_cfg or SpecConfig("ngram", num_tokens=num_tokens))
    return Engine(ReferenceBackend(weights), ByteTokenizer(), EngineConfig(**cfg), eos, speculator=speculator)


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def check_pages(engine: Engine) -> None:
    """Page invariants between steps: block tables cover exactly the computed positions, refcounts equal the
    number of block tables holding a page, and every registered page's hash names the tokens it holds."""
    from mimw.kv.prefix import chain_hashes

    ps = engine.config.page_size
    holders: dict[int, int] = {}
    for r in engine.scheduler.running + list(engine.scheduler.waiting):
        assert len(r.block_table) == -(-r.num_computed // ps), (r.request_id, len(r.block_table), r.num_computed)
        assert r.num_computed < r.num_tokens
        for p in r.block_table:
            holders[p] = holders.get(p, 0) + 1
        if engine.prefix is not None:
            hashes = chain_hashes(r.token_ids[:r.num_registered * ps], ps)
            for i in range(r.num_registered):
                assert i < len(r.block_table), (r.request_id, r.status, r.num_registered, r.block_table, r.num_computed)
                h = engine.prefix._hash_of.get(r.block_table[i])
                assert h is None or h == hashes[i]
    for p in range(engine.allocator.num_pages):
        assert engine.allocator.refcount(p) == holders.get(p, 0), p
