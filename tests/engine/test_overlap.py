"""The overlapped engine (engine/overlap.py) on a tiny random model: the same tokens, text, finish reasons and
counters as the synchronous engine, for greedy and seeded sampling, across batch sizes, stops, aborts, preemption
and prefix reuse; every page comes back and no page holding a token in flight is offered for reuse; decode steps
take their input ids from the device tensor of the previous step's samples; requests that need the host between
two tokens are resolved in their own step."""
from __future__ import annotations

import threading

import pytest
import torch

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.loop import EngineLoop
from mimw.engine.overlap import needs_host
from mimw.engine.sampling import SamplingParams
from mimw.kv.prefix import chain_hashes

from engine_helpers import ByteTokenizer, greedy_alone

PROMPTS = [[1, 5, 9, 33, 70, 12, 200, 4, 8, 100, 101, 17, 3], [7, 7, 7], list(range(40, 75)), [250, 3, 99, 42],
           [65, 66, 67, 68, 69], list(range(100, 140)), [9] * 9, [3, 1, 4, 1, 5, 9, 2, 6]]


def make(weights, overlap: bool, **cfg) -> Engine:
    return Engine(ReferenceBackend(weights), ByteTokenizer(), EngineConfig(overlap=overlap, **cfg))


def check_pages(engine: Engine) -> None:
    """Between steps: block tables cover the computed positions, refcounts match the holders, and every page
    offered to the prefix cache holds known tokens only (never one still in flight) under the right hash."""
    ps = engine.config.page_size
    holders: dict[int, int] = {}
    for r in engine.scheduler.running + list(engine.scheduler.waiting):
        assert len(r.block_table) == -(-r.num_computed // ps)
        assert r.num_computed < r.num_tokens and r.num_inflight in (0, 1)
        assert r.num_registered * ps <= len(r.token_ids)
        for p in r.block_table:
            holders[p] = holders.get(p, 0) + 1
        hashes = chain_hashes(r.token_ids[:r.num_registered * ps], ps)
        for i in range(r.num_registered):
            h = engine.prefix._hash_of.get(r.block_table[i])
            assert h is None or h == hashes[i]
    for p in range(engine.allocator.num_pages):
        assert engine.allocator.refcount(p) == holders.get(p, 0), p


def run(engine: Engine, requests, abort_after: dict[str, int] | None = None, check: bool = True) -> dict:
    """Submit ``requests`` (id, prompt, params), step until idle (aborting a request once it has shown the given
    number of tokens); returns per request (tokens, text, finish reason, completion tokens)."""
    got: dict[str, list] = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, on_output=lambda e: got.setdefault(e.request_id, []).append(e))
    abort_after = dict(abort_after or {})
    for _ in range(5000):
        if not engine.has_work():
            break
        engine.step()
        if check:
            check_pages(engine)
        for rid, n in list(abort_after.items()):
            if sum(len(e.token_ids) for e in got.get(rid, [])) >= n:
                engine.abort(rid)
                del abort_after[rid]
    assert not engine.has_work()
    assert engine.stats().pages_in_use == 0 and engine.stats().running == 0
    return {rid: ([t for e in ev for t in e.token_ids], "".join(e.text for e in ev), ev[-1].finish_reason,
                  ev[-1].completion_tokens) for rid, ev in got.items()}


def both(weights, requests, abort_after=None, **cfg):
    a, b = make(weights, False, **cfg), make(weights, True, **cfg)
    want, got = run(a, requests, abort_after), run(b, requests, abort_after)
    extra = 0
    for rid in abort_after or {}:  # an abort after n tokens seen finds the overlapped engine one token further
        w, g = want.pop(rid), got.pop(rid)
        extra += len(g[0]) - len(w[0])
        assert g[2] == w[2] == "abort" and g[0][:len(w[0])] == w[0] and len(g[0]) in (len(w[0]), len(w[0]) + 1)
    assert got == want
    sa, sb = a.stats(), b.stats()
    assert (sa.generation_tokens + extra, sa.prompt_tokens) == (sb.generation_tokens, sb.prompt_tokens)
    return got, b


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_and_seeded_sampling_match_the_synchronous_engine(tiny_weights, batch):
    reqs = []
    for i in range(batch):
        p = PROMPTS[i % len(PROMPTS)]
        kind = i % 4
        params = (greedy(12) if kind == 0 else
                  SamplingParams(temperature=0.9, seed=i, max_tokens=12, ignore_eos=True) if kind == 1 else
                  SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02, logit_bias={7: 5.0}, seed=100 + i,
                                 max_tokens=10, ignore_eos=True) if kind == 2 else
                  SamplingParams(temperature=0.7, frequency_penalty=0.5, seed=7, max_tokens=9, ignore_eos=True))
        reqs.append((f"r{i}", p, params))
    got, _ = both(tiny_weights, reqs, num_pages=128, page_size=4, max_batch=8)
    assert got["r0"][0] == greedy_alone(tiny_weights, PROMPTS[0], 12)


def test_no_step_is_spent_on_a_request_whose_token_in_flight_is_its_last(tiny_weights):
    reqs = [(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS[:4], (1, 5, 9, 9)))]
    a, b = make(tiny_weights, False, num_pages=64, page_size=4), make(tiny_weights, True, num_pages=64, page_size=4)
    assert run(a, reqs) == run(b, reqs)
    assert a.stats().steps == b.stats().steps == 9


def test_stops_mid_batch_eos_stop_strings_and_lengths(tiny_weights):
    base = {i: greedy_alone(tiny_weights, p, 16) for i, p in enumerate(PROMPTS[:6])}
    reqs = [("eos", PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[base[0][4]])),
            ("len3", PROMPTS[1], greedy(3)),
            ("len1", PROMPTS[2], greedy(1)),
            ("long", PROMPTS[3], greedy(16)),
            ("seeded-eos", PROMPTS[4], SamplingParams(temperature=1.0, seed=3, max_tokens=16, stop_token_ids=[2, 101])),
            ("text", PROMPTS[5], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                stop=[ByteTokenizer().decode(base[5][5:7])]))]
    got, _ = both(tiny_weights, reqs, num_pages=64, page_size=4, max_batch=8)
    assert got["eos"][0] == base[0][:5] and got["eos"][2] == "stop"
    assert got["len3"][2] == "length" and len(got["len3"][0]) == 3 and len(got["len1"][0]) == 1
    assert got["long"][0] == base[3] and got["text"][2] == "stop" and len(got["text"][0]) < 16


def test_aborts_and_preemption(tiny_weights):
    short = [PROMPTS[i] for i in (0, 1, 3, 4, 6, 7)]
    reqs = [(f"r{i}", p, greedy(14)) for i, p in enumerate(short)]
    # 10 pages of 4 tokens for 6 requests of up to 27 tokens: the newest ones are preempted and recomputed
    got, eng = both(tiny_weights, reqs, abort_after={"r1": 3, "r4": 1}, num_pages=10, page_size=4, max_batch=4,
                    max_step_tokens=64)
    assert eng.stats().preemptions > 0
    for i in (0, 2, 3, 5):
        assert got[f"r{i}"][0] == greedy_alone(tiny_weights, short[i], 14)


def test_prefix_reuse_after_overlapped_requests_finish(tiny_weights):
    eng = make(tiny_weights, True, num_pages=64, page_size=4, max_batch=4)
    first = run(eng, [(f"a{i}", p, greedy(9)) for i, p in enumerate(PROMPTS[:3])])
    # the second wave continues the first's sequences: their full pages (prompt and outputs) are reused
    second = [(f"b{i}", p + first[f"a{i}"][0], greedy(6)) for i, p in enumerate(PROMPTS[:3])]
    got = run(eng, second)
    for rid, p, _ in second:
        assert got[rid][0] == greedy_alone(tiny_weights, p, 6)
    assert eng.stats().prefix_hit_tokens > 0


def test_decode_steps_feed_the_device_tensor_and_launch_before_reading(tiny_weights):
    eng = make(tiny_weights, True, num_pages=64, page_size=4, max_batch=4)
    calls = []
    real = eng.backend.forward

    def spy(tokens, segments, cache):
        inflight = eng._inflight
        calls.append((tokens, inflight.feed if inflight is not None else None, len(seen)))
        return real(tokens, segments, cache)

    eng.backend.forward = spy
    seen = []
    for i in range(2):
        eng.add_request(f"r{i}", PROMPTS[i], greedy(5), on_output=seen.append)
    while eng.has_work():
        eng.step()
    # step 2 runs before the host has any token of step 1; decode steps take the previous samples as they are
    assert calls[1][2] == 0 and calls[1][0] is calls[1][1]
    assert all(tok is feed for tok, feed, _ in calls[1:])
    assert [e.token_ids for e in seen if e.request_id == "r0"][0] == tuple(greedy_alone(tiny_weights, PROMPTS[0], 1))


def test_requests_that_need_the_host_are_resolved_in_their_step(tiny_weights):
    assert needs_host(SamplingParams(logprobs=1)) and needs_host(SamplingParams(presence_penalty=1.0))
    assert not needs_host(SamplingParams(temperature=0.5, top_p=0.9, logit_bias={3: 1.0}))
    eng = make(tiny_weights, True, num_pages=64, page_size=4)
    eng.add_request("lp", PROMPTS[0], greedy(3, logprobs=2))
    for n in (1, 2):
        ev = eng.step()
        assert [len(e.token_ids) for e in ev] == [1] and len(ev[0].logprobs) == 1 and eng._inflight is None
    eng.add_request("plain", PROMPTS[1], greedy(3))
    ev = eng.step()  # a mixed step is resolved at once too: the logprobs request cannot wait for its token
    assert sorted(e.request_id for e in ev) == ["lp", "plain"]


def test_failed_forward_with_a_step_in_flight(tiny_weights):
    eng = make(tiny_weights, True, num_pages=64, page_size=4)
    eng.add_request("a", PROMPTS[0], greedy(8))
    eng.step()
    eng.step()
    real = eng.backend.forward
    eng.backend.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
    ev = eng.step()
    assert [len(e.token_ids) for e in ev] == [1, 0] and ev[-1].finish_reason == "error"  # step 2's token, then fail
    eng.backend.forward = real
    assert not eng.has_work() and eng.stats().pages_in_use == 0


@pytest.mark.gpu
def test_overlap_on_the_gpu_matches_the_synchronous_engine(tiny_weights):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = tiny_weights.to(device="cuda")
    reqs = [(f"r{i}", p, greedy(10) if i % 2 else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10))
            for i, p in enumerate(PROMPTS)]
    both(w, reqs, num_pages=128, page_size=4, max_batch=8)


hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                            reason="the megakernel needs a Hopper (sm_90) GPU")


@pytest.mark.gpu
@hopper
def test_megakernel_decode_and_device_sampling_never_synchronise():
    """The megakernel's replays (the batch-1 path, and the per-sequence path of small batches) and the device
    sampler queue their work without waiting for the GPU: the overlapped engine's launch path."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.sampling import sample_ids
    from mimw.models.reference import Segment
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    mk = MegakernelBackend(random_weights(spec, 3, dtype=torch.bfloat16, device="cuda"))
    cache = mk.make_cache(16, 16)
    segs = [Segment((1, 2), 20, 1), Segment((3, 4, 5), 40, 1)]
    tokens = torch.tensor([5, 9], device="cuda")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, top_k=40, logit_bias={3: 1.0})]
    ids = sample_ids(mk.decode_replays(tokens, segs, cache), params, [0.0, 0.5])  # compiles, captures the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # the next step's tokens are the previous samples, on the device
            ids = sample_ids(mk.decode_replays(ids.clamp(min=0), segs, cache), params, [0.0, 0.5])
        one = sample_ids(mk.forward(ids[:1].clamp(min=0), segs[:1], cache), params[:1], [0.0])  # batch 1: replay
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(0 <= t < spec.vocab_size for t in ids.tolist() + one.tolist())


@pytest.mark.gpu
@hopper
def test_megakernel_multi_token_steps_and_graphed_pass_never_synchronise():
    """The megakernel's multi-token step (a decode batch padded to its bucket, a verify block's logit rows) and the
    graphed prefill-path pass load their inputs in one copy from pinned memory (``StepInputs``) and hand back their
    logits without waiting for the GPU: the overlapped engine's path at batch 8 and 32."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.sampling import sample_ids
    from mimw.models.reference import Segment
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    mk = MegakernelBackend(random_weights(spec, 3, dtype=torch.bfloat16, device="cuda"))
    cache = mk.make_cache(16, 32)
    decode = [Segment((1, 2), 20, 1), Segment((3, 4, 5), 40, 1), Segment((6,), 7, 1)]  # 3 tokens: padded to 4
    verify = [Segment((7, 8), 21, 3, 2), Segment((9, 10, 11), 41, 1)]  # rows 1, 2 and 3: by an index, not a slice
    params = [SamplingParams(temperature=0)] * 4
    steps = [(mk.decode_kernel, decode), (mk.decode_kernel, verify), (mk.decode_pass, decode),
             (mk.decode_pass, verify)]
    ids = torch.tensor([5, 9, 11, 13], device="cuda")
    for _ in range(2):  # compiles; the pass's patterns run eager when first seen and are captured when seen again
        for step, segs in steps:
            step(ids[:sum(s.length for s in segs)], segs, cache)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # the next step's tokens are the previous samples, on the device
            for step, segs in steps:
                n = sum(s.length for s in segs)
                out = step(ids[:n], segs, cache)
                ids = torch.cat([sample_ids(out, params[:out.shape[0]], [0.0] * out.shape[0]), ids])[:4]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(0 <= t < spec.vocab_size for t in ids.tolist())


@pytest.mark.gpu
@hopper
def test_megakernel_engine_with_overlap_matches_the_synchronous_engine():
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights
    from mimw.server.main import ByteTokenizer as WideBytes  # ids past 255 decode to nothing

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 3, dtype=torch.bfloat16, device="cuda")
    backend = MegakernelBackend(w)

    def engine(overlap: bool) -> Engine:  # one request at a time: every decode step is one megakernel launch
        return Engine(backend, WideBytes(), EngineConfig(overlap=overlap, num_pages=64, page_size=16, max_batch=1))

    reqs = [(f"r{i}", [t + 3 for t in p], greedy(12)) for i, p in enumerate(PROMPTS[:4])]
    first = run(engine(False), reqs, check=False)
    stop = first["r1"][0][3]  # r1 stops at its 4th token: the overlapped engine discards the token after it
    reqs[1] = ("r1", reqs[1][1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
    want, got = run(engine(False), reqs, check=False), run(engine(True), reqs, check=False)
    assert got == want and got["r1"][2] == "stop" and len(got["r1"][0]) <= 4


def test_step_tokens_feeds_a_decode_step_from_the_device_and_builds_any_other():
    from mimw.engine.overlap import InFlight, step_tokens
    from mimw.pinned import PinnedRing
    from mimw.engine.request import Request
    from mimw.engine.scheduler import Chunk

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    greedy = SamplingParams(temperature=0.0)
    reqs = [Request(f"r{i}", torch.randint(1, 200, (int(n),), generator=g).tolist(), greedy)
            for i, n in enumerate(torch.randint(3, 12, (4,), generator=g))]
    ids = torch.randint(0, 256, (4,), generator=g)
    cpu = torch.device("cpu")
    f = InFlight(reqs, ids, may_fail=False, ring=PinnedRing(4, cpu))
    decode = [Chunk(r, len(r.token_ids), 1) for r in reqs]
    assert step_tokens(decode, {}, f, cpu) is f.feed  # every token in flight, in the in-flight order
    assert step_tokens(decode[::-1], {}, f, cpu).tolist() == ids.flip(0).tolist()  # another order: gathered
    assert step_tokens(decode[:3], {}, f, cpu).tolist() == ids[:3].tolist()  # fewer requests: gathered
    r = reqs[1]  # a chunk that reruns known tokens and ends at the one in flight (a recomputation)
    mixed = [decode[0], Chunk(r, 1, len(r.token_ids)), *decode[2:]]
    assert step_tokens(mixed, {}, f, cpu).tolist() == [ids[0].item(), *r.token_ids[1:], *ids[1:].tolist()]
    known = [Chunk(q, 0, len(q.token_ids)) for q in reqs]  # no token in flight: all from the host
    assert step_tokens(known, {}, None, cpu).tolist() == sum((q.token_ids for q in reqs), [])


def test_a_profiled_step_names_its_phases_and_an_unprofiled_one_enters_none(tiny_weights):
    """The engine's phases (mimw.profiling.phase) are ``record_function`` ranges in a profiled run, in step order,
    and a shared no-op otherwise."""
    from torch.profiler import profile

    from mimw.profiling import phase

    assert phase("schedule") is phase("forward")  # no profiler: the one shared null context
    eng = make(tiny_weights, True)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(str(i), p, SamplingParams(max_tokens=4), lambda o: None)
    eng.step()  # the prompts
    with profile() as prof:
        eng.step()  # a decode step: the prompts' tokens are read while it runs
    names = [e.name for e in prof.events() if e.name.startswith("mimw.")]
    assert names == ["mimw.schedule", "mimw.forward", "mimw.commit", "mimw.sample", "mimw.read", "mimw.append"]
    # the engine's loop thread, profiled from another thread (the overlap bench's setting)
    from mimw.bench.overlap import all_threads

    done = threading.Event()
    with profile(experimental_config=all_threads()) as prof:
        loop = EngineLoop(eng).start()
        loop.submit("late", PROMPTS[3], SamplingParams(max_tokens=3), lambda o: o.finished and done.set())
        assert done.wait(60)
        loop.stop()
    names = {e.name for e in prof.events() if e.name.startswith("mimw.")}
    assert {"mimw.step", "mimw.inbox", "mimw.schedule", "mimw.forward", "mimw.sample"} <= names

