"""The engine with speculation on a tiny random model: outputs exactly those of plain decoding (greedy and seeded
sampling), no trace of rejected tokens in the cache, stops inside a block, aborts, mixed batches, counters."""
from __future__ import annotations

import random

import pytest
import torch

from mimw.engine.sampling import SamplingParams
from mimw.engine.spec.block import BlockDrafter
from mimw.engine.spec.draft_model import DraftModelDrafter
from mimw.engine.backends.reference import ReferenceBackend
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.weights import random_weights

from engine_helpers import greedy_alone, run_all
from spec_helpers import (FailingDrafter, GarbageDrafter, ScriptedDrafter, check_pages, spec_engine, tokens)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def repetitive_prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randint(3, 255) for _ in range(rng.randint(2, 6))]
        out.append([rng.randint(3, 255) for _ in range(rng.randint(1, 5))] + motif * rng.randint(2, 5))
    return out


def run_checked(eng, max_steps=10_000):
    events: dict[str, list] = {}
    for _ in range(max_steps):
        if not eng.has_work():
            return events
        for ev in eng.step():
            events.setdefault(ev.request_id, []).append(ev)
        check_pages(eng)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_output_is_unchanged_by_each_drafter_under_any_batching(tiny_weights, method, seed):
    rng = random.Random(seed)
    ps = rng.choice([2, 4, 8])
    prompts = repetitive_prompts(seed)
    eng = spec_engine(tiny_weights, method=method, num_tokens=rng.choice([2, 4, 8]), page_size=ps,
                      num_pages=rng.randint(60 // ps + 1, 200 // ps), max_batch=rng.randint(1, 5),
                      max_step_tokens=rng.randint(6, 40))
    n = 16
    want = [greedy_alone(tiny_weights, p, n) for p in prompts]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(n))
    got = run_checked(eng)
    assert [tokens(got[f"r{i}"]) for i in range(len(prompts))] == want
    s = eng.stats()
    assert s.pages_in_use == 0 and s.spec.verify_steps > 0


def test_rejected_tokens_leave_no_trace_in_the_cache(tiny_weights):
    """Garbage drafts are (nearly) all rejected; the K/V of every computed position must equal a clean run's, and
    a later request that reuses the registered pages must still match the oracle."""
    eng = spec_engine(tiny_weights, drafter=GarbageDrafter(1), num_tokens=7, page_size=4, num_pages=40)
    prompt = list(range(30, 52))
    eng.add_request("a", prompt, greedy(20))
    events = []
    for _ in range(6):
        events += eng.step()
        check_pages(eng)
    r = eng.scheduler.running[0]
    dec = ReferenceDecoder(tiny_weights)
    clean = type(eng.cache)(eng.cache.layout)
    dec.forward(torch.tensor(r.token_ids[:r.num_computed]), [Segment(tuple(r.block_table), 0, r.num_computed)], clean)
    for layer in range(tiny_weights.spec.num_layers):
        k, v = eng.cache.gather(layer, r.block_table, r.num_computed)
        k0, v0 = clean.gather(layer, r.block_table, r.num_computed)
        torch.testing.assert_close(k, k0)
        torch.testing.assert_close(v, v0)
    assert eng.stats().spec.draft_tokens > eng.stats().spec.accepted_tokens
    events += run_checked(eng)["a"]
    assert tokens(events) == greedy_alone(tiny_weights, prompt, 20)
    full = greedy_alone(tiny_weights, prompt, 20)
    eng.add_request("b", prompt + full[:12] + [7], greedy(6))  # shares the pages "a" registered
    ev = run_checked(eng)
    assert ev["b"][-1].cached_tokens > 0
    assert tokens(ev["b"]) == greedy_alone(tiny_weights, prompt + full[:12] + [7], 6)


def script_for(weights, prompts, n):
    return {tuple(p): greedy_alone(weights, p, n) for p in prompts}


def test_stops_inside_an_accepted_block_behave_as_without_speculation(tiny_weights, make_engine):
    prompt = [5, 9, 33, 70, 12, 200, 4]
    ref = greedy_alone(tiny_weights, prompt, 24)
    text = bytes(t for t in ref if t > 2).decode("utf-8", errors="replace")
    cases = {"tok": greedy(24, stop_token_ids=(ref[5],)), "len": greedy(6),
             "str": greedy(24, stop=(text[4:6],)) if len(text) > 6 else greedy(24)}
    for name, params in cases.items():
        plain = make_engine(num_pages=32, page_size=4)
        plain.add_request(name, prompt, params)
        want = run_all(plain)[name]
        drafter = ScriptedDrafter(script_for(tiny_weights, [prompt], 24))
        eng = spec_engine(tiny_weights, drafter=drafter, num_tokens=8, num_pages=32, page_size=4)
        eng.add_request(name, prompt, params)
        got = run_checked(eng)[name]
        assert tokens(got) == tokens(want) and "".join(e.text for e in got) == "".join(e.text for e in want)
        assert got[-1].finish_reason == want[-1].finish_reason
        assert got[-1].completion_tokens == want[-1].completion_tokens
        assert len(got) < len(want) or len(want) == 1  # several tokens per step: the block was accepted
        assert eng.stats().pages_in_use == 0 and drafter.finished == [name]


def test_eos_inside_a_block(tiny_weights):
    prompt = [5, 9, 33, 70, 12]
    ref = greedy_alone(tiny_weights, prompt, 12)
    eng = spec_engine(tiny_weights, drafter=ScriptedDrafter(script_for(tiny_weights, [prompt], 12)), num_tokens=8,
                      eos=(ref[3],), num_pages=32, page_size=4)
    eng.add_request("e", prompt, SamplingParams(temperature=0, max_tokens=12))
    ev = run_checked(eng)["e"]
    assert tokens(ev) == ref[:4] and ev[-1].finish_reason == "stop"


def test_context_limit_inside_a_block(tiny_weights):
    prompt = list(range(40, 53))
    eng = spec_engine(tiny_weights, drafter=ScriptedDrafter(script_for(tiny_weights, [prompt], 7)), num_tokens=8,
                      num_pages=8, page_size=4, max_model_len=20)
    eng.add_request("c", prompt, greedy(7))
    ev = run_checked(eng)["c"]
    assert tokens(ev) == greedy_alone(tiny_weights, prompt, 7) and ev[-1].finish_reason == "length"


def test_abort_after_a_speculative_step_frees_everything(tiny_weights):
    drafter = ScriptedDrafter(script_for(tiny_weights, [[7, 8, 9]], 40))
    eng = spec_engine(tiny_weights, drafter=drafter, num_tokens=6, num_pages=32, page_size=4)
    seen = []
    eng.add_request("a", [7, 8, 9], greedy(40), on_output=seen.append)
    eng.step(), eng.step()
    assert len(seen[-1].token_ids) > 1 and eng.stats().pages_in_use > 0
    assert eng.abort("a")
    assert seen[-1].finish_reason == "abort" and eng.stats().pages_in_use == 0 and drafter.finished == ["a"]


def test_speculating_and_plain_requests_share_a_batch(tiny_weights):
    prompts = repetitive_prompts(7, 6)
    drafter = ScriptedDrafter(script_for(tiny_weights, prompts, 12), noise=0.3)
    eng = spec_engine(tiny_weights, drafter=drafter, num_tokens=4, num_pages=96, page_size=4, max_batch=6)
    for i, p in enumerate(prompts):  # prompt logprobs need a row per prompt token: such requests decode plainly
        eng.add_request(f"r{i}", p, greedy(12) if i % 2 else greedy(12, prompt_logprobs=1))
    got = run_checked(eng)
    for i, p in enumerate(prompts):
        assert tokens(got[f"r{i}"]) == greedy_alone(tiny_weights, p, 12)
    asked = {rid for rid, _ in drafter.asked}
    assert asked == {"r1", "r3", "r5"}
    assert eng.stats().spec.accepted_tokens > 0


def test_logprobs_of_speculated_tokens_equal_plain_decodings(tiny_weights, make_engine):
    prompts = repetitive_prompts(9, 3)
    params = [greedy(12, logprobs=3), SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True,
                                                     logprobs=0), greedy(12, logprobs=1, stop_token_ids=(7,))]
    plain = make_engine(num_pages=64, page_size=4)
    eng = spec_engine(tiny_weights, drafter=ScriptedDrafter(script_for(tiny_weights, prompts, 12)), num_tokens=4,
                      num_pages=64, page_size=4)
    for e in (plain, eng):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            e.add_request(f"r{i}", p, sp)
    want, got = run_all(plain), run_checked(eng)
    assert eng.stats().spec.accepted_tokens > 0
    for rid in want:
        assert tokens(got[rid]) == tokens(want[rid])
        a = [lp for e in got[rid] for lp in e.logprobs]
        b = [lp for e in want[rid] for lp in e.logprobs]
        assert [x.token_id for x in a] == [x.token_id for x in b] and len(a) == len(b)
        assert [x.logprob for x in a] == pytest.approx([x.logprob for x in b], abs=1e-4)
        assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]


def test_seeded_sampling_is_unchanged_by_deterministic_drafts(tiny_weights, make_engine):
    prompts = repetitive_prompts(3, 4)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=100 + i, max_tokens=14, ignore_eos=True)
              for i in range(4)]
    plain = make_engine(num_pages=64, page_size=4)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        plain.add_request(f"r{i}", p, sp)
    want = {k: tokens(v) for k, v in run_all(plain).items()}
    for method in ("ngram", "suffix"):
        eng = spec_engine(tiny_weights, method=method, num_tokens=4, num_pages=64, page_size=4)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}", p, sp)
        assert {k: tokens(v) for k, v in run_checked(eng).items()} == want


def test_counters_and_a_failing_drafter(tiny_weights):
    prompt = [7, 8, 9]
    eng = spec_engine(tiny_weights, drafter=ScriptedDrafter(script_for(tiny_weights, [prompt], 9)), num_tokens=4,
                      num_pages=32, page_size=4)
    eng.add_request("a", prompt, greedy(9))
    run_checked(eng)
    s = eng.stats().spec
    # 9 tokens, all drafts right: prefill-time draft of 4 (5 tokens), then a draft of 3 (room), then 1 token left
    assert s.accepted_tokens == s.draft_tokens and s.accepted_tokens + s.verify_steps <= 9
    assert sum(s.accepted_hist) == s.verify_steps and s.mean_emitted > 2
    eng = spec_engine(tiny_weights, drafter=FailingDrafter(), num_pages=32, page_size=4)
    eng.add_request("b", prompt, greedy(5))
    ev = run_checked(eng)["b"]
    assert tokens(ev) == greedy_alone(tiny_weights, prompt, 5) and eng.stats().spec.drafter_errors > 0


# --- drafters that run models ----------------------------------------------------------------------------------

@pytest.mark.parametrize("same", [True, False])
def test_draft_model_keeps_its_cache_in_sync_and_output_unchanged(tiny_weights, same):
    draft_w = tiny_weights if same else random_weights(tiny_weights.spec, seed=9)
    drafter = DraftModelDrafter(ReferenceBackend(draft_w), num_pages=64, page_size=4)
    prompts = repetitive_prompts(11, 4)
    eng = spec_engine(tiny_weights, drafter=drafter, num_tokens=5, num_pages=96, page_size=4, max_batch=4)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(15))
    events: dict[str, list] = {}
    while eng.has_work():
        for ev in eng.step():
            events.setdefault(ev.request_id, []).append(ev)
        check_pages(eng)
        for r in eng.scheduler.running:  # the draft cache holds a prefix of the request plus unverified drafts
            cached = drafter.cached_tokens(r.request_id)
            n = min(len(cached), r.num_tokens)
            assert cached[:n - 1] == r.token_ids[:n - 1] or not cached
    for i, p in enumerate(prompts):
        assert tokens(events[f"r{i}"]) == greedy_alone(tiny_weights, p, 15)
    s = eng.stats().spec
    if same:  # the target drafting for itself: every draft is accepted
        assert s.accepted_tokens == s.draft_tokens > 0
    assert drafter.num_sequences == 0 and drafter.alloc.num_in_use == 0


def test_draft_model_rollback_reuses_the_accepted_prefix(tiny_weights):
    drafter = DraftModelDrafter(ReferenceBackend(tiny_weights), num_pages=16, page_size=4)
    from mimw.engine.spec.drafter import DraftInput
    toks = [5, 6, 7, 8, 9]
    [d] = drafter.propose([DraftInput("a", toks, 5, greedy(10))], [4])
    assert drafter.cached_tokens("a") == toks + list(d.tokens[:3])
    # the target accepted 2 drafts and emitted its own token: the cache keeps prompt + 2 accepted
    nxt = toks + list(d.tokens[:2]) + [(d.tokens[2] + 1) % 256]
    [d2] = drafter.propose([DraftInput("a", nxt, 5, greedy(10))], [2])
    assert drafter.cached_tokens("a") == nxt + [d2.tokens[0]]
    assert len(drafter._seqs["a"].block_table) == -(-len(drafter.cached_tokens("a")) // 4)


def test_draft_model_without_pages_drafts_nothing(tiny_weights):
    from mimw.engine.spec.drafter import DraftInput
    drafter = DraftModelDrafter(ReferenceBackend(tiny_weights), num_pages=2, page_size=4)
    [d] = drafter.propose([DraftInput("a", list(range(3, 12)), 9, greedy(10))], [4])
    assert d.tokens == () and drafter.alloc.num_in_use == 0


class ScriptedBlock:
    """A block model test double: logits peaked on the known continuation (a trained block drafter's best case)."""

    def __init__(self, script, vocab):
        self.script, self.vocab, self.calls = script, vocab, 0

    def draft_block(self, contexts, k):
        self.calls += 1
        out = torch.zeros(len(contexts), k, self.vocab)
        for i, ctx in enumerate(contexts):
            for prompt, cont in self.script.items():
                if tuple(ctx[:len(prompt)]) == prompt:
                    done = len(ctx) - len(prompt)
                    for j, t in enumerate(cont[done:done + k]):
                        out[i, j, t] = 10.0
        return out


def test_block_drafter_one_call_per_step(tiny_weights):
    prompts = repetitive_prompts(5, 3)
    model = ScriptedBlock(script_for(tiny_weights, prompts, 16), 256)
    eng = spec_engine(tiny_weights, drafter=BlockDrafter(model), num_tokens=4, num_pages=64, page_size=4)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(16))
    got = run_checked(eng)
    assert [tokens(got[f"r{i}"]) for i in range(3)] == [greedy_alone(tiny_weights, p, 16) for p in prompts]
    assert model.calls <= eng.stats().steps and eng.stats().spec.mean_emitted > 3
