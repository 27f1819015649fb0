"""The GPU prefill path (bf16, Triton kernels) against the fp32 reference decoder (marker `gpu`): prompts of 1, 17,
1000 and 4096+13 tokens chunked at several sizes over shuffled block tables, a prefix already in the cache with
several segments in one call, four model shapes (two layers each), each attention (mimw's paged Triton kernel;
torch's FlashAttention-2, cuDNN, SDPA and FlexAttention over gathered pages); and decode after prefill
through the engine on the megakernel gives the reference's greedy tokens."""
import pytest
import torch

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

    def caches(self, pages: int) -> tuple[PagedKVCache, PagedKVCache]:
        ref = PagedKVCache(KVLayout.for_spec(self.spec, PAGE, pages, torch.float32), "cuda")
        ours = PagedKVCache(KVLayout.for_spec(self.spec, PAGE, pages, torch.bfloat16), "cuda")
        ours.k.fill_(float("nan"))  # a position read before it is written poisons the result
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
                                                for a in ("triton", "flash", "cudnn", "sdpa") for n in sorted(CHUNKS)])
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
                                                for a in ("triton", "flash", "cudnn", "sdpa", "flex")])
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


class _Ids:
    """A tokenizer for random-weight models: every id is one character."""

    def decode(self, ids) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_engine_decodes_the_reference_greedy_tokens_after_chunked_prefill():
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.engine import Engine, EngineConfig
    from mimw.engine.sampling import SamplingParams

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, seed=3, device="cuda")
    engine = Engine(MegakernelBackend(w.to(dtype=torch.bfloat16)), _Ids(),
                    EngineConfig(num_pages=160, page_size=PAGE, max_batch=4, max_step_tokens=256))
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
        cache = PagedKVCache(KVLayout.for_spec(spec, PAGE, 64, torch.float32), "cuda")
        logits = ref.forward(torch.tensor(seq), [Segment(tuple(range(64)), 0, len(seq))], cache)
        rows = logits[len(p) - 1:len(seq) - 1]  # the reference's prediction of every generated token
        chosen = rows.gather(1, torch.tensor(out[k], device="cuda")[:, None])[:, 0]
        # greedy: each token is the reference's argmax, up to a near-tie that bf16 may break the other way
        gap = rows.max(dim=1).values - chosen
        assert (gap <= 2e-2 * rows.abs().max(dim=1).values).all(), (k, gap.tolist())
        assert (gap == 0).sum() >= 14
