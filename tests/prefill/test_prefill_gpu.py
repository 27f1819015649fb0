"""The GPU prefill path (bf16, Triton kernels) against the fp32 reference decoder (marker `gpu`): prompts of 1, 17,
1000 and 4096+13 tokens chunked at several sizes over shuffled block tables, a prefix already in the cache with
several segments in one call, four model shapes (two layers each), each attention (mimw's paged Triton kernel,
its Gluon kernel for Hopper (bf16 only; passes of pieces of at most 128 tokens run on the Triton kernel there);
torch's cuDNN, SDPA and FlexAttention over gathered pages); the same over an fp8 KV cache
(against the reference over an fp8 cache; the append's bytes and scales are fp8.quantize's bit for bit); and decode
after prefill through the engine on the megakernel, bf16 and fp8 KV, gives the reference's greedy tokens."""
import pytest
import torch

from mimw.kv import fp8
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.prefill import FusedWeights, PrefillConfig, PrefillRunner

pytestmark = pytest.mark.gpu

SHAPES = ["smollm2-135m", "llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"]
PAGE = 16
CHUNKS = {1: [1], 17: [17, 5], 1000: [1000, 256, 333], 4109: [4109, 1024, 1000]}


class Model:
    """One shape with two layers: fp32 weights for the reference, a runner per attention over their bf16 copy."""

    def __init__(self, preset: str):
        self.spec = get_preset(preset).with_(num_layers=2)
        w = random_weights(self.spec, seed=7, device="cuda")
        self.ref = ReferenceDecoder(w)
        self.fused = FusedWeights.from_weights(w.to(dtype=torch.bfloat16))
        self.runners: dict[str, PrefillRunner] = {}

    def runner(self, attention: str) -> PrefillRunner:
        if attention not in self.runners:
            self.runners[attention] = PrefillRunner(self.fused, PrefillConfig(attention))
        return self.runners[attention]

    def caches(self, pages: int, kv: str = "bf16") -> tuple[PagedKVCache, PagedKVCache]:
        """(the reference's cache: fp32, or fp8 for kv "fp8"; ours: bf16 or fp8, poisoned with NaN)."""
        quantized = kv == "fp8"
        ref = PagedKVCache(KVLayout.for_spec(self.spec, PAGE, pages, fp8.FP8 if quantized else torch.float32), "cuda")
        ours = PagedKVCache(KVLayout.for_spec(self.spec, PAGE, pages, fp8.FP8 if quantized else torch.bfloat16),
                            "cuda")
        if quantized:  # a position read before it is written poisons the result
            ours.k.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
            ours.v.view(torch.uint8).fill_(0x7F)
            ours.k_scale.fill_(float("nan"))
            ours.v_scale.fill_(float("nan"))
        else:
            ours.k.fill_(float("nan"))
            ours.v.fill_(float("nan"))
        return ref, ours


_models: dict[str, Model] = {}


def model(preset: str) -> Model:
    if preset not in _models:
        _models.clear()  # one shape's weights on the GPU at a time
        torch.cuda.empty_cache()
        _models[preset] = Model(preset)
    return _models[preset]


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 over two layers against fp32: within 2% of the logits' range, and the same argmax wherever the
    reference's top two are further apart than the error."""
    assert torch.isfinite(got).all()
    err = (got - want).abs().max(dim=-1).values
    assert (err / want.abs().max(dim=-1).values).max() < 2e-2
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def shuffled_table(pages: int, n: int, seed: int) -> tuple[int, ...]:
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    return tuple(perm[:-(-n // PAGE)].tolist())


# one shape after the other (its weights are built once); mimw's kernel first
@pytest.mark.parametrize("preset,attention,n", [(p, a, n) for p in SHAPES
                                                for a in ("triton", "gluon", "cudnn", "sdpa") for n in sorted(CHUNKS)])
def test_chunked_prefill_matches_the_reference(preset, n, attention):
    m = model(preset)
    run = m.runner(attention)
    pages = -(-n // PAGE) + 8
    table = shuffled_table(pages, n, seed=n)
    toks = torch.randint(m.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    ref_cache, _ = m.caches(pages)
    want = m.ref.forward(toks, [Segment(table, 0, n)], ref_cache, last_only=True)
    pos = torch.arange(n, device="cuda")
    pages_of, rows_of = ref_cache.slots(table, pos)
    for chunk in CHUNKS[n]:
        _, cache = m.caches(pages)
        for s in range(0, n, chunk):
            got = run.forward(toks[s:s + chunk], [Segment(table, s, min(chunk, n - s))], cache)
        assert_logits_close(got, want)
        for li in range(m.spec.num_layers):  # the K/V the megakernel will read, where it will read them
            for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
                x, y = a[li, pages_of, :, rows_of].float(), b[li, pages_of, :, rows_of]
                assert ((x - y).abs().max() / y.abs().max()) < 2e-2


@pytest.mark.parametrize("preset,attention", [(p, a) for p in SHAPES
                                                for a in ("triton", "gluon", "cudnn", "sdpa", "flex")])
def test_prefix_in_cache_and_several_segments_in_one_call(preset, attention):
    """A holds 700 tokens; one call then continues A by a 5-token verify block (5 logit rows), prefills B whose
    first 32 pages are A's (prefix reuse: B computes only its 300 new tokens) and a fresh 40-token C."""
    if attention == "flex" and preset != "llama-3.2-1b":
        pytest.skip("FlexAttention compiles per shape: one shape keeps the GPU run short")
    m = model(preset)
    run = m.runner(attention)
    pages = 120
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).tolist()
    ta = tuple(perm[:45])
    tb = ta[:32] + tuple(perm[45:64])
    tc = tuple(perm[64:67])
    g = torch.Generator().manual_seed(2)
    a = torch.randint(m.spec.vocab_size, (705,), generator=g)
    b_new = torch.randint(m.spec.vocab_size, (300,), generator=g)
    c = torch.randint(m.spec.vocab_size, (40,), generator=g)
    step = [Segment(ta, 700, 5, num_logits=5), Segment(tb, 512, 300), Segment(tc, 0, 40)]
    toks = torch.cat([a[700:], b_new, c])
    ref_cache, cache = m.caches(pages)
    m.ref.forward(a[:700], [Segment(ta, 0, 700)], ref_cache)
    run.forward(a[:700], [Segment(ta, 0, 700)], cache)
    want = m.ref.forward(toks, step, ref_cache, last_only=True)
    got = run.forward(toks, step, cache)
    assert got.shape == (7, m.spec.vocab_size)
    assert_logits_close(got, want)


def _rows(cache: PagedKVCache, name: str, li: int, pages_of, rows_of) -> torch.Tensor:
    """Layer li's K or V rows at (pages_of, rows_of), fp32 (an fp8 cache's dequantised)."""
    if cache.layout.quantized:
        return cache.load(name, li, pages_of, rows_of)
    return (cache.k if name == "k" else cache.v)[li, pages_of, :, rows_of].float()


@pytest.mark.parametrize("preset,attention,n", [(p, a, n) for p in ("llama-3.2-1b", "qwen3-0.6b")
                                                for a in ("triton", "cudnn", "sdpa")
                                                for n in (17, 1000, 4109)])
def test_chunked_prefill_over_an_fp8_cache_matches_the_reference_over_one(preset, attention, n):
    """The bf16 path over an fp8 KV cache against the fp32 reference over an fp8 cache: logits as close as bf16's,
    and the rows the megakernel will read within an e4m3 step of the reference's."""
    m = model(preset)
    run = m.runner(attention)
    pages = -(-n // PAGE) + 8
    table = shuffled_table(pages, n, seed=n)
    toks = torch.randint(m.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    ref_cache, _ = m.caches(pages, "fp8")
    want = m.ref.forward(toks, [Segment(table, 0, n)], ref_cache, last_only=True)
    pages_of, rows_of = ref_cache.slots(table, torch.arange(n, device="cuda"))
    for chunk in CHUNKS[n][:2]:
        _, cache = m.caches(pages, "fp8")
        for s in range(0, n, chunk):
            got = run.forward(toks[s:s + chunk], [Segment(table, s, min(chunk, n - s))], cache)
        assert_logits_close(got, want)
        for li in range(m.spec.num_layers):
            for name in ("k", "v"):
                x, y = _rows(cache, name, li, pages_of, rows_of), _rows(ref_cache, name, li, pages_of, rows_of)
                # bf16 vs fp32 rows quantised: the same e4m3 value but across a rounding boundary (one step, 1/8
                # of the element's binade at most)
                assert ((x - y).abs().max() / y.abs().max()) < 8e-2


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"])
def test_rope_append_into_fp8_on_the_gpu_is_fp8_quantize_bit_for_bit(preset):
    """On the GPU (div.rn, cvt.rn.satfinite): the kernel's fp8 bytes and scales are fp8.quantize of the rows its
    bf16 store writes, and, without a head norm, the torch twin's; zero rows get scale 1."""
    from mimw.models import rope
    from mimw.prefill import rope_append
    from mimw.prefill.batch import Piece, PrefillBatch

    spec = get_preset(preset)
    hq, hkv, hd, pages = spec.num_heads, spec.num_kv_heads, spec.head_dim, 40
    perm = shuffled_table(pages, pages * PAGE, 3)  # disjoint tables: no slot written twice
    batch = PrefillBatch.build([Piece(perm[:19], 0, 300), Piece(perm[19:24], 40, 37)], PAGE, "cuda")
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(batch.num_tokens, (hq + 2 * hkv) * hd, generator=g) *
           torch.logspace(-3, 4, batch.num_tokens)[:, None]).bfloat16().cuda()
    qkv[7] = 0
    cos, sin = rope.cos_sin(spec, batch.positions)
    qn = (1 + 0.1 * torch.randn(hd, generator=g)).bfloat16().cuda() if spec.qk_norm else None
    kn = (1 + 0.1 * torch.randn(hd, generator=g)).bfloat16().cuda() if spec.qk_norm else None
    eps = spec.rms_norm_eps
    kb, vb = (torch.zeros(pages, hkv, PAGE, hd, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    rope_append.rope_append(qkv, cos, sin, kb, vb, batch.slots, hq, qn, kn, eps)
    k8, v8 = (torch.zeros(pages, hkv, PAGE, hd, dtype=fp8.FP8, device="cuda") for _ in range(2))
    ks, vs = (torch.ones(pages, hkv, PAGE, dtype=fp8.SCALE_DTYPE, device="cuda") for _ in range(2))
    rope_append.rope_append(qkv, cos, sin, k8, v8, batch.slots, hq, qn, kn, eps, ks, vs)
    pg, rw = batch.slots // PAGE, batch.slots % PAGE
    for got, got_s, rows in ((k8, ks, kb), (v8, vs, vb)):
        want, want_s = fp8.quantize(rows[pg, :, rw])
        assert torch.equal(got.view(torch.uint8)[pg, :, rw], want.view(torch.uint8))
        assert torch.equal(got_s[pg, :, rw], want_s)
    assert (ks[pg[7], :, rw[7]] == 1).all() and (vs[pg[7], :, rw[7]] == 1).all()
    if not spec.qk_norm:
        k2, v2 = (torch.zeros_like(k8) for _ in range(2))
        ks2, vs2 = (torch.ones_like(ks) for _ in range(2))
        rope_append.rope_append_torch(qkv, cos, sin, k2, v2, batch.slots, hq, qn, kn, eps, ks2, vs2)
        for a, b in ((k8, k2), (v8, v2), (ks, ks2), (vs, vs2)):
            assert torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                               b.view(torch.uint8) if b.dtype == fp8.FP8 else b)


class _Ids:
    """A tokenizer for random-weight models: every id is one character."""

    def decode(self, ids) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_engine_decodes_the_reference_greedy_tokens_after_chunked_prefill(kv):
    """bf16 KV: against the fp32 reference over an fp32 cache; fp8 KV: over an fp8 cache (the same quantisation of
    every row, up to bf16 vs fp32 activations)."""
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.engine import Engine, EngineConfig
    from mimw.engine.sampling import SamplingParams

    kv_dtype = fp8.FP8 if kv == "fp8" else torch.bfloat16
    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, seed=3, device="cuda")
    engine = Engine(MegakernelBackend(w.to(dtype=torch.bfloat16), kv_dtype=kv_dtype), _Ids(),
                    EngineConfig(num_pages=160, page_size=PAGE, max_batch=4, max_step_tokens=256))
    assert engine.cache.layout.dtype == kv_dtype
    g = torch.Generator().manual_seed(4)
    prompts = {"long": torch.randint(spec.vocab_size, (900,), generator=g).tolist(),
               "short": torch.randint(spec.vocab_size, (37,), generator=g).tolist()}
    out = {k: [] for k in prompts}
    for k, p in prompts.items():
        engine.add_request(k, p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for _ in range(200):
        if not engine.has_work():
            break
        for ev in engine.step():
            assert ev.error is None, ev.error
            out[ev.request_id].extend(ev.token_ids)
    ref = ReferenceDecoder(w)
    for k, p in prompts.items():
        assert len(out[k]) == 16
        seq = p + out[k]
        cache = PagedKVCache(KVLayout.for_spec(spec, PAGE, 64, fp8.FP8 if kv == "fp8" else torch.float32), "cuda")
        logits = ref.forward(torch.tensor(seq), [Segment(tuple(range(64)), 0, len(seq))], cache)
        rows = logits[len(p) - 1:len(seq) - 1]  # the reference's prediction of every generated token
        chosen = rows.gather(1, torch.tensor(out[k], device="cuda")[:, None])[:, 0]
        # greedy: each token is the reference's argmax, up to a near-tie that bf16 may break the other way
        gap = rows.max(dim=1).values - chosen
        assert (gap <= 2e-2 * rows.abs().max(dim=1).values).all(), (k, gap.tolist())
        assert (gap == 0).sum() >= 14
