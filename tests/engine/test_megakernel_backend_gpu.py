"""The megakernel engine backend (Hopper GPU): prefill on the reference path, decode on the megakernel, both over
one paged cache (bf16, and fp8 in the first test); logits track the fp32 reference backend step by step (marker
`gpu`)."""
import pytest
import torch

from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_megakernel_backend_decodes_like_the_reference(kv):
    """fp8: both backends over an fp8 cache (the megakernel's prefill path and decode kernel write it)."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend
    from mimw.kv import fp8

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 3, dtype=torch.bfloat16, device="cuda")
    kv_dtype = fp8.FP8 if kv == "fp8" else None
    mk, ref = MegakernelBackend(w, kv_dtype=kv_dtype), ReferenceBackend(w.to(dtype=torch.float32), kv_dtype=kv_dtype)
    assert mk.kv_dtype == (kv_dtype or torch.bfloat16)
    mk_cache, ref_cache = mk.make_cache(16, 8), ref.make_cache(16, 8)
    assert mk_cache.layout.dtype == mk.kv_dtype
    table = (5, 2, 7, 0, 1, 3)
    prompt = torch.randint(spec.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    a = mk.forward(prompt, [Segment(table, 0, 37)], mk_cache)
    b = ref.forward(prompt, [Segment(table, 0, 37)], ref_cache)
    agree = 0
    for i in range(20):
        tok = int(b[0].argmax())
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2
        agree += int(a[0].argmax() == b[0].argmax())
        a = mk.forward(torch.tensor([tok]), [Segment(table, 37 + i, 1)], mk_cache)
        b = ref.forward(torch.tensor([tok]), [Segment(table, 37 + i, 1)], ref_cache)
    assert agree >= 19


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_megakernel_backend_batch_step_matches_the_reference_and_single_steps():
    """A step of several decode sequences (and a prefill chunk beside them) goes through one call; its logits track
    the reference and the single-sequence megakernel steps of the same tokens."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 4, dtype=torch.bfloat16, device="cuda")
    mk, ref = MegakernelBackend(w), ReferenceBackend(w.to(dtype=torch.float32))
    mk_cache, ref_cache = mk.make_cache(16, 40), ref.make_cache(16, 40)
    g = torch.Generator().manual_seed(1)
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(5)]
    lens = [37, 5, 90, 16]
    for t, n in zip(tables, lens):  # four sequences' prompts
        p = torch.randint(spec.vocab_size, (n,), generator=g)
        mk.forward(p, [Segment(t, 0, n)], mk_cache)
        ref.forward(p, [Segment(t, 0, n)], ref_cache)
    chunk = torch.randint(spec.vocab_size, (21,), generator=g)
    toks = torch.randint(spec.vocab_size, (4,), generator=g)
    segs = [Segment(t, n, 1) for t, n in zip(tables, lens)]
    mixed = segs + [Segment(tables[4], 0, 21, 2)]
    a = mk.forward(torch.cat([toks, chunk]), mixed, mk_cache)
    b = ref.forward(torch.cat([toks, chunk]), mixed, ref_cache)
    assert a.shape == b.shape == (6, spec.vocab_size)
    assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 5 / 6
    # the same decode tokens again (rewriting the same K/V rows): as a batch on both paths the router has, then one
    # sequence a step (the megakernel)
    for _ in range(9):  # the router tries each path (warm-up, then two measures; a step that captured a graph is
        # none): the decode-batch kernel, the pass (graphed), then replays
        d = mk.forward(toks, segs, mk_cache)
        assert d.shape == (4, spec.vocab_size)
        assert ((d - a[:4]).abs().max() / a[:4].abs().max()).item() < 2e-2
    for i, s in enumerate(segs):
        one = mk.forward(toks[i:i + 1], [s], mk_cache)
        assert ((one[0] - a[i]).abs().max() / a[i].abs().max()).item() < 2e-2
    assert 4 in mk.router.batched_ms and mk.router.replay_ms is not None and 4 in mk.router.step_ms["kernel"]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_prepare_compiles_every_kernel_a_decode_batch_of_any_size_launches():
    """After ``prepare``, decode steps of every bucket and verify steps of any layout find their kernel compiled:
    the JIT's cache of the megakernel does not grow."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.megakernel.device.kernel import megakernel

    def compiled() -> int:
        return sum(len(c[0]) for c in megakernel.device_caches.values())

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    mk = MegakernelBackend(random_weights(spec, 6, dtype=torch.bfloat16, device="cuda"))
    cache = mk.make_cache(16, 64)
    mk.prepare(cache)
    n = compiled()
    assert n >= 1 + 2 * 5  # M = 1; buckets 2..32, their decode batch and query-block kernels
    tables = [(2 * i, 2 * i + 1) for i in range(32)]
    g = torch.Generator().manual_seed(3)
    mk.forward(torch.randint(spec.vocab_size, (32 * 9,), generator=g), [Segment(t, 0, 9) for t in tables], cache)
    toks = torch.randint(spec.vocab_size, (32,), generator=g).cuda()
    for b in (1, 2, 3, 5, 9, 17, 32):
        segs = [Segment(t, 9, 1) for t in tables[:b]]
        out = mk.decode_replays(toks[:1], segs[:1], cache) if b == 1 else mk.decode_kernel(toks[:b], segs, cache)
        assert torch.isfinite(out).all()
    # verify layouts of buckets 4, 16 and 32 (prepare compiled one layout a bucket; every layout's kernel is that
    # one: the same constants, and int arguments padded to one specialization class, state.unspecialized)
    for lens in ((2, 1), (3, 1), (5, 9), (16, 3, 1), (7, 7, 7, 7)):
        segs = [Segment(tables[i], 9, n, n) for i, n in enumerate(lens)]
        out = mk.decode_kernel(toks[:sum(lens)], segs, cache)
        assert out.shape == (sum(lens), spec.vocab_size) and torch.isfinite(out).all()
    assert compiled() == n


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_a_layout_dropped_from_the_decoders_kept_runs_again_as_before(monkeypatch):
    """The decoder keeps the last MAX_DECODERS layouts; a dropped one is planned again on its next step and gives
    the same logits, bit for bit (same inputs, same cache rows)."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.megakernel.launch import decoder

    monkeypatch.setattr(decoder, "MAX_DECODERS", 2)
    spec = get_preset("smollm2-135m").with_(num_layers=4)
    mk = MegakernelBackend(random_weights(spec, 7, dtype=torch.bfloat16, device="cuda"))
    cache = mk.make_cache(16, 16)
    tables = [(2 * i, 2 * i + 1) for i in range(4)]
    g = torch.Generator().manual_seed(4)
    mk.forward(torch.randint(spec.vocab_size, (4 * 9,), generator=g), [Segment(t, 0, 9) for t in tables], cache)
    toks = torch.randint(spec.vocab_size, (8,), generator=g).cuda()
    layouts = [(2, 1), (3, 1), (1, 2, 1), (4, 4)]
    run = lambda lens: mk.decode_kernel(  # noqa: E731
        toks[:sum(lens)], [Segment(tables[i], 9, n, n) for i, n in enumerate(lens)], cache).clone()
    first = [run(lens) for lens in layouts]
    assert len(mk._dec._batches) == 2
    again = [run(lens) for lens in layouts]
    assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_a_new_cache_frees_the_previous_one_and_steps_over_it_as_before():
    """An engine replacing another on one backend (the trace bench's setups): once the first engine drops its
    cache, the backend holds nothing of it (its decoder and step graphs went when the second cache was made), so
    its pool is freed before the second engine runs; steps over the new cache give the first cache's logits."""
    import gc
    import weakref

    from mimw.engine.backends.megakernel import MegakernelBackend

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    mk = MegakernelBackend(random_weights(spec, 5, dtype=torch.bfloat16, device="cuda"))
    prompt = torch.randint(spec.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    segs = [Segment((0, 1, 2), 0, 30), Segment((4, 5, 6), 0, 30)]

    def run(cache):
        mk.forward(torch.cat([prompt, prompt]), segs, cache)
        toks = torch.tensor([7, 9], device="cuda")
        steps = [mk.forward(toks, [Segment(s.block_table, 30, 1) for s in segs], cache) for _ in range(4)]
        return torch.stack([mk.decode_replays(toks, [Segment(s.block_table, 30, 1) for s in segs], cache)] + steps)

    first = mk.make_cache(16, 64)
    a = run(first)
    assert mk._dec is not None and mk._dec.cache is first
    gone = weakref.ref(first)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    second = mk.make_cache(16, 64)
    del first
    gc.collect()
    assert gone() is None, "the backend still holds the first cache"
    assert torch.cuda.memory_allocated() <= before
    b = run(second)
    assert torch.isfinite(b).all()
    assert torch.equal(a[0], b[0])  # the one-token kernel, replayed: bit for bit
    assert ((a - b).abs().max() / a.abs().max()).item() < 2e-2  # the router's paths may differ from run to run


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_megakernel_backend_verify_step_matches_the_reference_on_both_of_its_paths():
    """A step of two verify blocks and a decode token (7 tokens, every block token's logits; the multi-token step
    pads it to 8 on the backend's own page) through the backend several times: the router tries the megakernel's
    multi-token step and the prefill pass (never replays), and every run's logits track the reference's over the
    same segments."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend
    from mimw.engine.backends.step_router import KERNEL, REPLAY

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 5, dtype=torch.bfloat16, device="cuda")
    mk, ref = MegakernelBackend(w), ReferenceBackend(w.to(dtype=torch.float32))
    mk_cache, ref_cache = mk.make_cache(16, 30), ref.make_cache(16, 30)
    g = torch.Generator().manual_seed(2)
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(3)]
    lens = [40, 9, 77]
    for t, n in zip(tables, lens):
        p = torch.randint(spec.vocab_size, (n,), generator=g)
        mk.forward(p, [Segment(t, 0, n)], mk_cache)
        ref.forward(p, [Segment(t, 0, n)], ref_cache)
    segs = [Segment(tables[0], 40, 4, 4), Segment(tables[1], 9, 2, 2), Segment(tables[2], 77, 1, 1)]
    toks = torch.randint(spec.vocab_size, (7,), generator=g)
    want = ref.forward(toks, segs, ref_cache)
    for _ in range(14):  # the same block again (rewriting the same rows): warm-up and two measures of each path (a
        # time is read at the next step; the pass's pattern runs eager when first seen and is captured when seen
        # again, neither of them a measure)
        got = mk.forward(toks, segs, mk_cache)
        assert got.shape == want.shape == (7, spec.vocab_size)
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 6 / 7
    assert 8 in mk.router.step_ms[KERNEL] and 8 in mk.router.batched_ms and mk.router.replay_ms is None
    assert REPLAY not in mk.router.step_ms
    # every step counted by the path it ran: the three prompts one pass each, the 14 verify steps the router's
    assert mk.steps_by_path["prefill"] == 3 and sum(mk.steps_by_path.values()) == 3 + 14
    assert mk.steps_by_path[KERNEL] >= 3 and mk.steps_by_path["batched"] >= 3 and mk.steps_by_path[REPLAY] == 0


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_megakernel_backend_decodes_an_moe_model_like_the_reference():
    """Qwen3-MoE (tiny): prefill on the bf16 reference decoder, decode on the megakernel's MoE layers, one cache.
    Routing near-ties can swap an expert on some step (bf16 against fp32): the argmax agrees on most steps."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend

    spec = get_preset("tiny-qwen3-moe")
    w = random_weights(spec, 3, dtype=torch.bfloat16, device="cuda")
    mk, ref = MegakernelBackend(w), ReferenceBackend(w.to(dtype=torch.float32))
    mk_cache, ref_cache = mk.make_cache(16, 8), ref.make_cache(16, 8)
    table = (5, 2, 7, 0, 1, 3)
    prompt = torch.randint(spec.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    a = mk.forward(prompt, [Segment(table, 0, 37)], mk_cache)
    b = ref.forward(prompt, [Segment(table, 0, 37)], ref_cache)
    agree, close = 0, 0
    for i in range(20):
        tok = int(b[0].argmax())
        close += int(((a - b).abs().max() / b.abs().max()).item() < 2e-2)
        agree += int(a[0].argmax() == b[0].argmax())
        a = mk.forward(torch.tensor([tok]), [Segment(table, 37 + i, 1)], mk_cache)
        b = ref.forward(torch.tensor([tok]), [Segment(table, 37 + i, 1)], ref_cache)
    assert agree >= 17 and close >= 15, (agree, close)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_megakernel_backend_runs_an_moe_models_decode_batches_on_its_multi_token_step():
    """Qwen3-MoE (tiny-qwen3-moe-mt: heads of 64, so its decode batches plan; hidden size 64, one column tile):
    prompts prefilled on the bf16 reference decoder, then decode batches of 2, 3, 5, 7 and 8 sequences on the
    megakernel's multi-token MoE step (``decode_kernel``: padded to their bucket by rows on the backend's own page,
    every row routed, each distinct expert read once), then one batch through ``forward`` until the router has
    measured that step. Every row's logits track the fp32 reference's; a routing near-tie (bf16 against fp32) may
    swap an expert on some rows, so most rows, not all, must be within the bound."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend
    from mimw.engine.backends.step_router import KERNEL
    from mimw.engine.step_costs import bucket
    from mimw.megakernel.plan import MAX_MOE_BATCH

    spec = get_preset("tiny-qwen3-moe-mt")
    w = random_weights(spec, 6, dtype=torch.bfloat16, device="cuda")
    mk, ref = MegakernelBackend(w), ReferenceBackend(w.to(dtype=torch.float32))
    assert mk.max_tokens == MAX_MOE_BATCH == 8
    mk_cache, ref_cache = mk.make_cache(16, 64), ref.make_cache(16, 64)
    g = torch.Generator().manual_seed(7)
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(8)]
    pos = [int(n) for n in torch.randint(3, 60, (8,), generator=g)]
    for t, n in zip(tables, pos):
        p = torch.randint(spec.vocab_size, (n,), generator=g)
        mk.forward(p, [Segment(t, 0, n)], mk_cache)
        ref.forward(p, [Segment(t, 0, n)], ref_cache)
    rows = close = agree = 0
    for batch in (2, 3, 5, 7, 8, 8):
        for _ in range(3):
            segs = [Segment(tables[i], pos[i], 1) for i in range(batch)]
            toks = torch.randint(spec.vocab_size, (batch,), generator=g)
            a = mk.decode_kernel(toks.cuda(), segs, mk_cache)
            b = ref.forward(toks, segs, ref_cache)
            assert a.shape == b.shape == (batch, spec.vocab_size) and torch.isfinite(a).all()
            err = (a - b).abs().amax(-1) / b.abs().amax(-1)
            rows += batch
            close += int((err < 2e-2).sum())
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            for i in range(batch):
                pos[i] += 1
    torch.cuda.synchronize()
    assert close >= 0.8 * rows and agree >= 0.9 * rows, (close, agree, rows)
    segs = [Segment(tables[i], pos[i], 1) for i in range(5)]
    toks = torch.randint(spec.vocab_size, (5,), generator=g)
    want = ref.forward(toks, segs, ref_cache)
    for _ in range(9):  # the same decode step again (rewriting its rows): the router tries each of its paths
        got = mk.forward(toks, segs, mk_cache)
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8
    assert bucket(5) in mk.router.step_ms[KERNEL]  # the router keeps a step's time by its bucket of tokens


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_thirty_two_concurrent_greedy_requests_give_the_reference_backends_tokens():
    """32 greedy requests at once through the engine (overlap on; its decode steps on the megakernel's multi-token
    step, the replays or the graphed pass, as the router picks) against the same requests through the fp32
    reference backend. A request's tokens must equal the reference's up to the first position where they differ,
    and that position must be a near-tie of the reference (its top two logprobs within ``tie``: bf16 arithmetic may
    pick either; from there on the two continuations legitimately differ); most requests never differ."""
    from engine_helpers import IdTokenizer, run_all

    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend
    from mimw.engine.engine import Engine, EngineConfig
    from mimw.engine.sampling import SamplingParams

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 5, dtype=torch.bfloat16, device="cuda")
    cfg = EngineConfig(num_pages=32 * 6 + 8, page_size=16, max_batch=32, max_step_tokens=512)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, spec.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 40, (32,), generator=g)]

    def run(backend, logprobs):
        eng = Engine(backend, IdTokenizer(), cfg)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                        logprobs=logprobs))
        events = run_all(eng)
        toks = {r: [t for e in ev for t in e.token_ids] for r, ev in events.items()}
        lps = {r: [lp for e in ev for lp in e.logprobs] for r, ev in events.items()}
        return toks, lps

    got, _ = run(MegakernelBackend(w), None)
    want, lps = run(ReferenceBackend(w.to(dtype=torch.float32)), 2)
    tie = 0.05  # nats between the reference's top two (random weights: their margins are mostly far wider)
    identical = 0
    for r in want:
        a, b = got[r], want[r]
        assert len(a) == len(b) == 24, (r, len(a), len(b))
        first = next((i for i in range(24) if a[i] != b[i]), None)
        if first is None:
            identical += 1
            continue
        (_, top1), (_, top2) = lps[r][first].top[:2]
        assert top1 - top2 <= tie, (r, first, a[first], b[first], top1 - top2)
    assert identical >= 28, identical


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_prepare_captures_every_decode_bucket_so_serving_steps_only_replay():
    """``prepare(cache, 8)`` captures the M = 1 step's graph, and the multi-token step's and the graphed pass's for
    buckets 2, 4 and 8, on the pad page; decode batches of 1..8 real sequences then replay them (no decoder built,
    no capture, no eager first sighting), their logits those of the reference on every path, and the warm-up wrote
    no sequence's K/V."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 8, dtype=torch.bfloat16, device="cuda")
    mk, ref = MegakernelBackend(w), ReferenceBackend(w.to(dtype=torch.float32))
    cache, ref_cache = mk.make_cache(16, 48), ref.make_cache(16, 48)
    g = torch.Generator().manual_seed(8)
    tables = [tuple(range(6 * i, 6 * i + 6)) for i in range(8)]
    for t in tables:  # the prompts first, so that the warm-up runs over a cache that holds sequences
        p = torch.randint(spec.vocab_size, (33,), generator=g)
        mk.forward(p, [Segment(t, 0, 33)], cache)
        ref.forward(p, [Segment(t, 0, 33)], ref_cache)
    before = cache.k.clone(), cache.v.clone()
    prompts = mk._graphs.patterns.captures, mk._graphs.patterns.eager  # the prompt steps' pattern
    mk.prepare(cache, 8)
    graphs, dec = mk._graphs, mk._dec
    one = dec.graph
    work = graphs.patterns.captures, graphs.patterns.eager
    assert work == (prompts[0] + 3, prompts[1] + 3) and one is not None  # buckets 2, 4, 8: a sighting, a capture
    kernels = {m: dec._batches[(m, ())].graph for m in (2, 4, 8)}
    assert all(g is not None for g in kernels.values())
    built = set(dec._batches)
    assert torch.equal(cache.k[:, :-1], before[0][:, :-1]) and torch.equal(cache.v[:, :-1], before[1][:, :-1])
    pos = 33
    for b in (1, 3, 8, 5, 2, 7):
        toks = torch.randint(spec.vocab_size, (b,), generator=g)
        segs = [Segment(t, pos, 1) for t in tables[:b]]
        want = ref.forward(toks, segs, ref_cache)
        outs = [mk.decode_replays(toks.cuda(), segs, cache)] if b == 1 else \
            [mk.decode_kernel(toks.cuda(), segs, cache), mk.decode_pass(toks.cuda(), segs, cache)]
        for out in outs:
            assert out.shape == want.shape
            assert ((out - want.cuda()).abs().max() / want.abs().max()).item() < 2e-2
        assert (graphs.patterns.captures, graphs.patterns.eager) == work
        assert mk._graphs is graphs and mk._dec is dec and dec.graph is one
        assert set(dec._batches) == built and all(dec._batches[(m, ())].graph is g for m, g in kernels.items())
        pos += 1
