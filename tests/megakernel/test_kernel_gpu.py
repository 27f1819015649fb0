"""The Gluon megakernel on a Hopper GPU against the fp32 reference decoder (marker `gpu`; skipped without CUDA).

Each check (tools/check.py) runs 64 consecutive decode steps on random weights over a random paged cache with a
shuffled block table, poisons the scratch before every launch, relaunches every step once more and compares bit for
bit (a moving result would be a race), and diffs the logits against the fp32 reference: within bf16 error, argmax
equal or a near-tie of the bf16 (transformers-numerics) reference's own error."""
import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mimw.megakernel.ops import attn_in
from mimw.megakernel.plan import Tuning
from mimw.models.spec import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the megakernel needs a Hopper (sm_90) GPU")]

MODELS = ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"]


def _matches_reference_over_64_steps(model, context, tuning=Tuning(), num_sms=None, layers=0):
    from mimw.bench.config import preset_spec
    from mimw.megakernel.tools.check import check_decode

    r = check_decode(preset_spec(model, layers), context, steps=64, tuning=tuning, num_sms=num_sms)
    assert r.finite, r
    assert r.bit_identical, f"repeated launches differ (race): {r}"
    assert r.max_rel_err <= 2e-2, r
    # exact agreement, or a near-tie: the oracle's top two closer than 2x the bf16 (transformers-numerics)
    # reference's own error on the same run (check.py)
    assert r.argmax_agree_or_tie >= 0.99, r
    # exact agreement against the fp32 oracle: bf16 itself flips near-ties (H200, 2026-12-02: 61/64 at 8B, ctx 17,
    # gaps 0.04-0.6% of max|logit| at a step error of 1.1-1.2%)
    assert r.argmax_agree >= 0.9, r
    # the K/V rows it appended, step by step (the references then read them: check.py)
    assert r.kv_rel_err <= max(1e-2, 2 * r.bf16_kv_rel_err), r
    return r


@pytest.mark.parametrize("context", [1, 17, 1000, 8191])
@pytest.mark.parametrize("model", MODELS)
def test_megakernel_matches_reference_over_64_steps(model, context):
    _matches_reference_over_64_steps(model, context)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_long_context_kv_ring_matches_reference_over_64_steps(model, kv):
    """Context 40000 (not a multiple of any block or page): each of a KV head's 16 splits streams ~2500 past
    positions through the ring (device/kv_stream.py: ~40 slots of the 1B's 64 bf16 positions, ~20 of its 128 fp8
    ones, 79 / 40 of the 8B's), its first slot starting before the split at a box boundary and its last running past
    it: the masks at both ends, the boxes past the split repeating the last, the block-table gather one slot ahead
    and the slots' phases over many laps of the ring. The 8B runs its first 8 layers (every layer streams alike): all
    32 with their fp32 oracle and its cache need more than an H100's 80 GB."""
    layers = 8 if model == "llama-3.1-8b" else 0
    if kv == "fp8":
        _fp8_matches_reference(model, 40000, layers=layers)
    else:
        _matches_reference_over_64_steps(model, 40000, layers=layers)


@pytest.mark.parametrize("model,context,kv,mma", [("llama-3.2-1b", 1000, "fp8", True),
                                                  ("llama-3.1-8b", 8191, "bf16", False),
                                                  ("llama-3.1-8b", 8191, "fp8", True)])
def test_both_ring_walks_match_reference_over_64_steps(model, context, kv, mma):
    """A one-token step's ring walk: on the tensor cores where a slot holds 16 positions a warp (ops/attn_ring_mma.py:
    the 1B's and SmolLM2's slots, every fp8 one), else the lanes' walk on the CUDA cores (the 8B's bf16 slot of 32
    positions). The other default tests walk SmolLM2 at 17 (a lone partial slot) and the 1B at 1000 over bf16,
    SmolLM2 at 17 and every model at 8191 over fp8, the 1B and the 8B at 40000 over both (many slots a split, masks
    at both ends); these add the 1B at 1000 over fp8 and the 8B's head_dim 128 at 8191 over both walks, on 8 layers."""
    from mimw.kv.pages import parse_kv_dtype
    from mimw.megakernel.plan import plan

    assert plan(get_preset(model), 132, kv_dtype=parse_kv_dtype(kv)).constants.ATTN_MMA == mma
    layers = 8 if model == "llama-3.1-8b" else 0
    if kv == "fp8":
        _fp8_matches_reference(model, context, layers=layers)
    else:
        _matches_reference_over_64_steps(model, context, layers=layers)


@pytest.mark.parametrize("model,context", [("smollm2-135m", 17), ("llama-3.2-1b", 1000), ("llama-3.1-8b", 8191),
                                           ("qwen3-8b", 1)])
def test_tickets_match_reference_over_64_steps(model, context):
    """Tuning(clusters=False), the fallback where clusters cannot be kept resident: ATTN_IN's column parts and the
    attention splits join through global tickets, DOWN_PROJ's blocks stay whole."""
    _matches_reference_over_64_steps(model, context, Tuning(clusters=False))


@pytest.mark.parametrize("model,context,num_sms", [("llama-3.2-1b", 1000, 114), ("llama-3.2-1b", 8191, 131)])
def test_other_sm_counts_match_reference_over_64_steps(model, context, num_sms):
    """114 SMs (an H100 PCIe): too few for every DOWN_PROJ row block to pair, so the 1B's DOWN_PROJ stays whole
    beside ATTN_IN's pairs; 131 SMs: odd, no clusters at all."""
    _matches_reference_over_64_steps(model, context, num_sms=num_sms)


@pytest.mark.parametrize("model,quiet,context", [("llama-3.2-1b", 0, 1000), ("llama-3.1-8b", -1, 17)])
def test_release_hold_settings_match_reference_over_64_steps(model, quiet, context):
    """Tuning(quiet=N) beside the default 2: the loader holds a new stage's tiles past the N-th until compute's
    previous release (device/ring.py); a hold that let a tile overtake its slot's barriers, or that never ended,
    would differ or hang. -1: no hold."""
    _matches_reference_over_64_steps(model, context, Tuning(quiet=quiet))


def test_cache_rows_past_2_31_elements_are_addressed_in_64_bits():
    """A pool whose last layers' rows lie past 2^31 elements (the 1B's 16 layers x 18000 pages x 8192 elements a
    page-layer: 2.36e9; the 8B's 32 layers pass it from ~4100 pages), the block table drawn from all of it: an int32
    element offset would wrap and read or write another row. Steps of one sequence through the whole pool's pages
    against the fp32 oracle (the pool 9.4 GB in bf16, its oracle copy 18.9 GB)."""
    from mimw.megakernel.tools.check import check_decode

    r = check_decode(get_preset("llama-3.2-1b"), 1000, steps=64, min_pages=18000)
    assert r.finite and r.bit_identical and r.max_rel_err <= 2e-2 and r.argmax_agree_or_tie >= 0.99, r
    assert r.kv_rel_err <= max(1e-2, 2 * r.bf16_kv_rel_err), r  # its rows written where the oracle writes them


def test_decoder_falls_back_to_tickets_where_the_clusters_do_not_all_fit(monkeypatch):
    """A GPU on which fewer clusters of two fit than the persistent kernel needs resident (patched here: none fit)
    gets the ticketed program with a warning, and decodes what the reference decodes; the cluster kernel, which
    would wait forever for CTAs that never start, is never launched."""
    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.megakernel.launch import clusters
    from mimw.megakernel.launch.decoder import MegakernelDecoder
    from mimw.models.weights import random_weights

    spec = get_preset("smollm2-135m")
    monkeypatch.setattr(clusters, "max_active_clusters", lambda *a, **k: 0)
    cache = PagedKVCache(KVLayout.for_spec(spec, 16, 8, torch.bfloat16), "cuda")
    with pytest.warns(RuntimeWarning, match="0 clusters of two fit"):
        dec = MegakernelDecoder(random_weights(spec, 0, dtype=torch.bfloat16, device="cuda"), cache)
    assert dec.cluster_fallback and dec.plan.exchange_bytes == 0 and not dec.program.attn_pairs
    with pytest.warns(RuntimeWarning, match="runs with tickets"):
        _matches_reference_over_64_steps("smollm2-135m", 1000)


def test_traced_launch_stamps_every_instruction_in_order_and_computes_the_same_logits():
    import dataclasses

    from mimw.megakernel.launch.decoder import MegakernelDecoder
    from mimw.megakernel.tools.check import random_cache
    from mimw.megakernel.tools.trace import summarize
    from mimw.models.weights import random_weights

    spec = get_preset("llama-3.2-1b")
    w = random_weights(spec, 3, dtype=torch.bfloat16, device="cuda")
    logits = []
    for tuning in (Tuning(), Tuning(trace=True)):
        cache, table = random_cache(spec, 100, 1, 16, 4)
        dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), tuning=tuning, context_hint=100)
        logits.append(dec.step(7, 100, table).clone())
    assert torch.equal(logits[0], logits[1])  # tracing changes timing, never results
    ins = dec.trace.cpu()  # per instruction: start <= dependency met <= outputs stored <= signalled
    for s, n in enumerate(dec.lens.cpu().tolist()):
        assert bool((ins[s, :n, 0] > 0).all()) and bool((ins[s, :n, :-1] <= ins[s, :n, 1:]).all())
        assert bool((ins[s, n:] == 0).all())
    out = summarize(dec.trace, dec.words, dec.lens)
    assert out["step_us"] > 0 and set(out["critical_path_us"]) >= {"ATTN_IN", "DOWN_PROJ", "layer"}


# --- an fp8 KV cache (e4m3 + a bf16 scale per (token, KV head), kv/fp8.py) -------------------------------------

@gluon.jit
def _store_rows(x_ptr, q_ptr, s_ptr, C: gl.constexpr):
    """Row program_id(0) of x [R, HD] fp32 through ATTN_IN's row store into q [R, HD] and s [R]."""
    r = gl.program_id(0)
    i = attn_in._half_index(C)
    a = gl.load(x_ptr + r * C.HD + i)
    bh = gl.load(x_ptr + r * C.HD + C.HD // 2 + i)
    attn_in.store_row(q_ptr + r * C.HD, s_ptr + r, a, bh, i, C)


def _fp8_matches_reference(model, context, tuning=Tuning(), min_pages=0, layers=0):
    """The kernel over an fp8 cache against the fp32 oracle over a copy of that very fp8 cache (tools/check.py):
    logits within bf16 error as above, and the rows the kernel appended are kv/fp8.py rows (re-quantising their
    dequantised values gives back their bytes and scales) within about one e4m3 step of the oracle's (their bytes
    rarely match exactly: the kernel's pre-quantisation rows carry bf16 activation rounding, the oracle's do not;
    ``test_fp8_row_store_is_bit_exact_with_the_host_quantiser`` checks the store itself bit for bit)."""
    from mimw.bench.config import preset_spec
    from mimw.kv import fp8
    from mimw.megakernel.tools.check import check_decode

    r = check_decode(preset_spec(model, layers), context, steps=64, tuning=tuning, kv_dtype=fp8.FP8,
                     min_pages=min_pages)
    assert r.finite and r.bit_identical, r
    assert r.max_rel_err <= 2e-2 and r.argmax_agree_or_tie >= 0.99 and r.argmax_agree >= 0.9, r
    assert r.kv_rows["requant_exact"], r.kv_rows
    # each side is within half an e4m3 step (2^-4 of the element) of its own fp32 row, and the two fp32 rows differ
    # by bf16 activation rounding (~1e-2): a wrong head, a swapped K/V or a bad scale is off by O(1)
    assert r.kv_rows["max_err"] <= 0.2, r.kv_rows
    return r


@pytest.mark.parametrize("context", [17, 8191])
@pytest.mark.parametrize("model", MODELS)
def test_fp8_kv_megakernel_matches_reference_over_the_same_fp8_cache(model, context):
    _fp8_matches_reference(model, context)


def test_fp8_kv_tickets_match_reference():
    _fp8_matches_reference("llama-3.2-1b", 8191, Tuning(clusters=False))


def test_fp8_cache_rows_past_2_31_elements_are_addressed_in_64_bits():
    """The fp8 pool of the 64-bit addressing test above (the 1B's 18000 pages; the 8B's pool at 128k holds 32 x 8193
    pages x 16384 elements = 4.3e9): the kernel over it against the oracle over a copy of the same fp8 cache."""
    _fp8_matches_reference("llama-3.2-1b", 1000, min_pages=18000)


@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b", "tiny-qwen3"])
def test_fp8_row_store_is_bit_exact_with_the_host_quantiser(model):
    """ATTN_IN's finisher stores a K/V row through ``attn_in.store_row``: the same device function, run here on
    hand-picked fp32 rows (random scales, a zero row, tiny rows near the 2^-126 scale floor, rows whose quotients sit
    on e4m3 rounding ties, rows with one dominant element), writes exactly the bytes and scales
    ``PagedKVCache.store`` writes for them."""
    from mimw.kv import fp8
    from mimw.megakernel.plan import plan

    spec = get_preset(model)
    c = plan(spec, 132, kv_dtype=fp8.FP8).constants
    hd, g = spec.head_dim, torch.Generator(device="cuda").manual_seed(0)
    rows = [torch.randn(256, hd, device="cuda", generator=g) * torch.logspace(-6, 4, 256, device="cuda")[:, None]]
    rows.append(torch.zeros(1, hd, device="cuda"))
    tiny = (1 + torch.rand(4, hd, device="cuda", generator=g)) * 2e-36  # normal, but amax / 448 < 2^-126
    rows.append(torch.where(torch.rand(4, hd, device="cuda", generator=g) < 0.5, -tiny, tiny))
    ties = torch.randint(-448, 449, (8, hd), device="cuda", generator=g).float() + 0.5  # x / 1.0 on halfway points
    ties[:, 0] = 448.0  # amax at most 448.5: scale bf16(amax / 448) = 1
    rows.append(ties)
    spike = torch.randn(8, hd, device="cuda", generator=g) * 0.01
    spike[:, 3] = 1000.0
    rows.append(spike)
    x = torch.cat(rows).contiguous()
    q = torch.full((x.shape[0], hd), 0x7F, dtype=torch.uint8, device="cuda")  # poisoned: e4m3 NaN
    s = torch.full((x.shape[0],), float("nan"), dtype=torch.bfloat16, device="cuda")
    _store_rows[(x.shape[0],)](x, q.view(fp8.FP8), s, C=c, num_warps=c.NW)
    eq, es = fp8.quantize(x)
    assert torch.equal(q, eq.view(torch.uint8)), (q != eq.view(torch.uint8)).nonzero()[:8]
    assert torch.equal(s, es)
