"""Speculative sampling is plain sampling in distribution: chi-square tests against the exact distribution.

A tiny vocabulary makes the exact distribution of the first tokens computable: p(t1 t2) = p(t1) p(t2 | t1) with the
filtered per-token distribution ``filtered_probs`` (temperature, top-k, top-p). Sampled outputs are binned into
those cells and compared with a chi-square test at a false-alarm rate of 1e-6, so a correct rule passes for
certain in practice while a wrong one (e.g. resampling from p instead of norm(max(0, p - q)) after a rejection)
fails by orders of magnitude at these sample counts.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

import pytest
import torch

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.sampling import SamplingParams, filtered_probs, make_generator, sample
from mimw.engine.spec.block import BlockDrafter
from mimw.engine.spec.config import SpecConfig
from mimw.engine.spec.drafter import Draft
from mimw.engine.spec.speculator import Speculator
from mimw.engine.spec.verify import verify
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.weights import random_weights

from engine_helpers import ByteTokenizer, run_all

V = 6
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)]


def chi_square_ok(counts: Counter, probs: dict, n: int, z: float = 4.75) -> tuple[bool, float, float]:
    """Pearson's chi-square of ``counts`` (n samples) against ``probs``; cells expected < 5 are pooled. The
    critical value is Wilson-Hilferty's approximation at the one-sided normal quantile z (4.75: p = 1e-6)."""
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for cell, p in probs.items():
        e = p * n
        if e < 5:
            pooled_e += e
            pooled_o += counts.get(cell, 0)
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-9)
        cells += 1
    outside = sum(c for cell, c in counts.items() if probs.get(cell, 0.0) == 0.0)
    df = max(cells - 1, 1)
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= crit and outside == 0, stat, crit


@functools.lru_cache(maxsize=None)
def table_logits(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    """A fixed random 'model': logits for the token after ``prefix`` (salt picks target vs drafter)."""
    g = torch.Generator().manual_seed(hash((salt,) + prefix) % (2**31))
    return torch.randn(V, generator=g) * 1.5


@functools.lru_cache(maxsize=None)
def draft_q(prefix: tuple[int, ...]) -> torch.Tensor:
    """The sampled drafter's q: hotter than the target, so it puts mass where top-k/top-p leave p none."""
    return filtered_probs(table_logits(prefix, 1), SamplingParams(temperature=1.3))


def exact(params: SamplingParams, n: int, logits_of) -> dict:
    out = {(): 1.0}
    for _ in range(n):
        out = {seq + (t,): p * float(filtered_probs(logits_of(seq), params)[t])
               for seq, p in out.items() for t in range(V)}
    return {k: v for k, v in out.items() if v > 0}


def speculative_run(params, gen, dgen, n_tokens: int, k: int, sampled_drafts: bool) -> tuple[int, ...]:
    """Generate n_tokens with drafts of k tokens from the salt-1 'drafter', verified against the salt-0 target."""
    out: tuple[int, ...] = ()
    while len(out) < n_tokens:
        toks, qs, ctx = [], [], out
        for _ in range(k):
            if sampled_drafts:
                q = draft_q(ctx)
                t = int(torch.multinomial(q, 1, generator=dgen))
                qs.append(q)
            else:
                t = int(torch.argmax(table_logits(ctx, 1)))
            toks.append(t)
            ctx = ctx + (t,)
        rows = torch.stack([table_logits(out + tuple(toks[:j]), 0) for j in range(k + 1)])
        draft = Draft(tuple(toks), torch.stack(qs) if qs else None)
        out = out + tuple(verify(rows, draft, params, gen))
    return out[:n_tokens]


@pytest.mark.parametrize("sampled_drafts", [False, True])
@pytest.mark.parametrize("params", PARAMS)
def test_verify_rule_samples_the_target_distribution(params, sampled_drafts):
    n, n_tokens = 4000, 2
    want = exact(params, n_tokens, lambda seq: table_logits(seq, 0))
    gen, dgen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts = Counter(speculative_run(params, gen, dgen, n_tokens, 2, sampled_drafts) for _ in range(n))
    ok, stat, crit = chi_square_ok(counts, want, n)
    assert ok, f"chi-square {stat:.1f} > {crit:.1f}: speculative sampling is not the target distribution"


def wrong_rule(logits, draft, params, gen):
    """The classic mistake: after a rejection, resample from p instead of norm(max(0, p - q))."""
    out = []
    for j, x in enumerate(draft.tokens):
        p = filtered_probs(logits[j], params)
        q = draft.probs[j] if draft.probs is not None else torch.nn.functional.one_hot(torch.tensor(x), V).float()
        if float(torch.rand((), generator=gen)) * float(q[x]) < float(p[x]):
            out.append(x)
            continue
        out.append(int(torch.multinomial(p, 1, generator=gen)))
        return out
    return out + [sample(logits[-1], params, gen)]


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_the_check_rejects_a_wrong_rule(monkeypatch, sampled_drafts):
    """The same check must fail for a wrong acceptance rule (the test has power)."""
    monkeypatch.setattr(__import__(__name__), "verify", wrong_rule)
    params = PARAMS[0]
    n = 4000
    want = exact(params, 2, lambda seq: table_logits(seq, 0))
    gen, dgen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts = Counter(speculative_run(params, gen, dgen, 2, 2, sampled_drafts) for _ in range(n))
    ok, stat, crit = chi_square_ok(counts, want, n)
    assert not ok and stat > 3 * crit, (stat, crit)


# --- the engine end to end: a tiny-vocabulary transformer, sampled block drafts -----------------------------------

class RandomBlock:
    """A block drafter test double: random logits that favour token 2 at every position, so q puts most of its
    mass on one token (a resampling mistake after rejections then shows up clearly)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(5)

    def draft_block(self, contexts, k):
        logits = torch.randn(len(contexts), k, self.vocab, generator=self.g)
        logits[:, :, 2] += 3.0
        return logits


def tiny_vocab_weights():
    spec = dataclasses.replace(get_preset("tiny-llama"), name="tiny-vocab", vocab_size=V, eos_token_ids=())
    return random_weights(spec, seed=3)


def model_exact(weights, prompt, params, n_tokens):
    dec = ReferenceDecoder(weights)

    def logits_of(seq):
        cache = PagedKVCache(KVLayout.for_spec(weights.spec, 16, 4, weights.dtype))
        toks = list(prompt) + list(seq)
        return dec.forward(torch.tensor(toks), [Segment(tuple(range(4)), 0, len(toks))], cache, last_only=True)[0]

    return exact(params, n_tokens, logits_of)


@pytest.mark.slow
def test_engine_speculative_sampling_matches_the_model_distribution():
    weights = tiny_vocab_weights()
    prompt = [1, 4, 2, 5]
    params = SamplingParams(temperature=2.5, top_k=5, max_tokens=3, ignore_eos=True)
    cfg = SpecConfig("ngram", num_tokens=2, max_verify_tokens=1024)
    spec = Speculator(BlockDrafter(RandomBlock(V), sample=True), cfg)
    eng = Engine(ReferenceBackend(weights), ByteTokenizer(), EngineConfig(num_pages=512, page_size=4, max_batch=128,
                                                                        max_step_tokens=1024), speculator=spec)
    n = 1500
    for i in range(n):
        eng.add_request(f"r{i}", prompt, dataclasses.replace(params, seed=i))
    events = run_all(eng)
    counts = Counter(tuple(t for e in events[f"r{i}"] for t in e.token_ids)[:2] for i in range(n))
    st = eng.stats().spec
    assert st.verify_steps >= n and st.accepted_tokens > 0  # drafts were verified and some kept
    ok, stat, crit = chi_square_ok(counts, model_exact(weights, prompt, params, 2), n)
    assert ok, f"chi-square {stat:.1f} > {crit:.1f}"
    assert eng.stats().pages_in_use == 0
