"""The prefill Triton kernels against their PyTorch references, run by Triton's interpreter on the CPU at small
shapes. Collected everywhere, run only in the TRITON_INTERPRET=1 process that ``tests/test_interpreter.py`` starts."""
import pytest
import torch
from interpret import ONLY_INTERPRETED, with_fixes  # noqa: F401 (an autouse fixture)

from mimw.kv import fp8
from mimw.models import rope
from mimw.models.spec import get_preset
from mimw.prefill import activation, norm, paged_attention, rope_append
from mimw.prefill.batch import Piece, PrefillBatch
from mimw.prefill.gathered_attention import torch_attention

pytestmark = ONLY_INTERPRETED


def close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, err


@pytest.mark.parametrize("t,d", [(1, 64), (5, 100)])
def test_rms_norm(t, d):
    g = torch.Generator().manual_seed(t)
    x = (3 * torch.randn(t, d, generator=g)).bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    want = norm.rms_norm_torch(x, w, 1e-5)
    # the rsqrt and the sum of squares run in another order than torch's: a bf16 step here and there
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-5), want, rtol=2 ** -6, atol=1e-3)


@pytest.mark.parametrize("i", [128, 1500])
def test_silu_mul(i):
    gu = (2 * torch.randn(7, 2 * i, generator=torch.Generator().manual_seed(i))).bfloat16()
    torch.testing.assert_close(activation.silu_mul(gu), activation.silu_mul_torch(gu), rtol=2 ** -6, atol=1e-3)


def _pieces(page_size: int, num_pages: int, seed: int):
    """Three sequences with shuffled block tables: one with a prefix already cached, one fresh, one single token."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    need = [-(-c // page_size) for c in (45, 19, 4)]
    tables, i = [], 0
    for n in need:
        tables.append(tuple(perm[i:i + n]))
        i += n
    return [Piece(tables[0], 20, 25, 1), Piece(tables[1], 0, 19, 1), Piece(tables[2], 3, 1, 1)]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama3", "tiny-qwen2"])
def test_rope_append_matches_the_reference_and_writes_only_its_slots(preset):
    spec = get_preset(preset)
    hq, hkv, hd, ps, pages = spec.num_heads, spec.num_kv_heads, spec.head_dim, 8, 12
    batch = PrefillBatch.build(_pieces(ps, pages, 1), ps, "cpu")
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch.num_tokens, (hq + 2 * hkv) * hd, generator=g).bfloat16()
    cos, sin = rope.cos_sin(spec, batch.positions)
    qn = (1 + 0.1 * torch.randn(hd, generator=g)).bfloat16() if spec.qk_norm else None
    kn = (1 + 0.1 * torch.randn(hd, generator=g)).bfloat16() if spec.qk_norm else None
    caches = [torch.randn(pages, hkv, ps, hd, generator=g).bfloat16() for _ in range(2)]  # stale contents
    k1, v1 = caches[0].clone(), caches[1].clone()
    k2, v2 = caches[0].clone(), caches[1].clone()
    q1 = rope_append.rope_append(qkv, cos, sin, k1, v1, batch.slots, hq, qn, kn, spec.rms_norm_eps)
    q2 = rope_append.rope_append_torch(qkv, cos, sin, k2, v2, batch.slots, hq, qn, kn, spec.rms_norm_eps)
    # a few roundings (head norm, weight, RoPE) after fp32 sums in another order than torch's: ~3 bf16 steps; a
    # wrong pairing or position would be off by O(1)
    close(q1, q2, 0.06)
    close(k1, k2, 0.06)
    assert torch.equal(v1, v2)
    written = torch.zeros(pages * ps, dtype=torch.bool)
    written[batch.slots] = True
    untouched = ~written.view(pages, ps)[:, None, :, None].expand_as(k1)
    assert torch.equal(k1[untouched], caches[0][untouched]) and torch.equal(v1[untouched], caches[1][untouched])


def _rope_case(preset: str, ps: int, pages: int, seed: int):
    spec = get_preset(preset)
    hq, hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    batch = PrefillBatch.build(_pieces(ps, pages, seed), ps, "cpu")
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(batch.num_tokens, (hq + 2 * hkv) * hd, generator=g).bfloat16()
    cos, sin = rope.cos_sin(spec, batch.positions)
    qn = (1 + 0.1 * torch.randn(hd, generator=g)).bfloat16() if spec.qk_norm else None
    kn = (1 + 0.1 * torch.randn(hd, generator=g)).bfloat16() if spec.qk_norm else None
    return spec, batch, qkv, cos, sin, qn, kn


def _page_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rows (page, row) of ``mask`` [P, PS] of a [P, Hkv, PS, ...] layer or scale tensor (fp8 as bytes)."""
    x = x.view(torch.uint8) if x.dtype == fp8.FP8 else x
    return x.transpose(1, 2)[mask]


def _fp8_layers(pages: int, hkv: int, ps: int, hd: int):
    """An fp8 layer pair with stale bytes and scales (a store that misses a row or writes a wrong one shows)."""
    g = torch.Generator().manual_seed(99)
    k, ks = fp8.quantize(torch.randn(pages, hkv, ps, hd, generator=g))
    v, vs = fp8.quantize(torch.randn(pages, hkv, ps, hd, generator=g))
    return k, v, ks, vs


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama3", "tiny-qwen2"])
def test_rope_append_into_an_fp8_cache_stores_fp8_quantize_of_the_bf16_rows(preset):
    """The fp8 store is fp8.quantize of exactly the rows the bf16 path stores (same kernel, bf16 cache), bytes and
    scales; rows outside the slots keep their stale bytes and scales; and, where the head norm's fp32 sums do not
    differ in order (no qk norm), the bytes are the torch twin's."""
    ps, pages = 8, 12
    spec, batch, qkv, cos, sin, qn, kn = _rope_case(preset, ps, pages, 1)
    hq, hkv, hd, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    kb, vb = torch.zeros(pages, hkv, ps, hd).bfloat16(), torch.zeros(pages, hkv, ps, hd).bfloat16()
    q_b16 = rope_append.rope_append(qkv, cos, sin, kb, vb, batch.slots, hq, qn, kn, eps)
    stale = _fp8_layers(pages, hkv, ps, hd)
    k8, v8, ks, vs = (x.clone() for x in stale)
    q8 = rope_append.rope_append(qkv, cos, sin, k8, v8, batch.slots, hq, qn, kn, eps, ks, vs)
    assert torch.equal(q8, q_b16)
    pg, rw = batch.slots // ps, batch.slots % ps
    for got, got_s, rows in ((k8, ks, kb), (v8, vs, vb)):
        want, want_s = fp8.quantize(rows[pg, :, rw])
        assert torch.equal(got.view(torch.uint8)[pg, :, rw], want.view(torch.uint8))
        assert torch.equal(got_s[pg, :, rw], want_s)
    written = torch.zeros(pages * ps, dtype=torch.bool)
    written[batch.slots] = True
    untouched = ~written.view(pages, ps)
    for got, old in zip((k8, v8, ks, vs), stale):
        assert torch.equal(_page_rows(got, untouched), _page_rows(old, untouched))
    if not spec.qk_norm:
        k2, v2, ks2, vs2 = (x.clone() for x in stale)
        q2 = rope_append.rope_append_torch(qkv, cos, sin, k2, v2, batch.slots, hq, qn, kn, eps, ks2, vs2)
        assert torch.equal(q8, q2)
        for a, b in ((k8, k2), (v8, v2)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(ks, ks2) and torch.equal(vs, vs2)


def test_rope_append_fp8_rows_at_the_edges_of_the_format():
    """Rows fp8.quantize treats specially, through the kernel and the torch twin, compared byte for byte: an
    all-zero row (scale 1), rows of large amax (scales far above 1), a row whose amax / 448 falls below bf16's
    smallest normal (the scale's floor), and ordinary rows. RoPE is the identity (cos 1, sin 0) so that the K rows
    are the GEMM output's as given."""
    hq, hkv, hd, ps, pages = 2, 2, 16, 4, 6
    slots = torch.tensor([5, 0, 22, 9, 13, 2, 17, 7], dtype=torch.long)
    t = slots.numel()
    g = torch.Generator().manual_seed(11)
    mag = torch.tensor([0.0, 3e4, 1e-37, 1.0, 2.5e38 / 448 / 4, 0.01, 448.0, 1.0])  # one per token row
    qkv = (torch.randn(t, (hq + 2 * hkv) * hd, generator=g) * mag[:, None]).bfloat16()
    qkv[3, :] = 0.0  # another all-zero row (every head)
    cos, sin = torch.ones(t, hd // 2), torch.zeros(t, hd // 2)
    stale = _fp8_layers(pages, hkv, ps, hd)
    outs = []
    for fn in (rope_append.rope_append, rope_append.rope_append_torch):
        k8, v8, ks, vs = (x.clone() for x in stale)
        fn(qkv, cos, sin, k8, v8, slots, hq, None, None, 1e-6, ks, vs)
        outs.append((k8.view(torch.uint8), v8.view(torch.uint8), ks, vs))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    k8, v8, ks, vs = outs[0]
    pg, rw = slots // ps, slots % ps
    kv = qkv[:, hq * hd:].view(t, 2, hkv, hd)
    k_rows = rope.apply_rope(kv[:, 0], cos, sin)  # the identity up to zeros' signs (-0 - 0 = +0)
    for got, got_s, rows in ((k8, ks, k_rows), (v8, vs, kv[:, 1])):
        want, want_s = fp8.quantize(rows)
        assert torch.equal(got[pg, :, rw], want.view(torch.uint8)) and torch.equal(got_s[pg, :, rw], want_s)
    assert (ks[pg[0], :, rw[0]] == 1).all() and (ks[pg[3], :, rw[3]] == 1).all()  # zero rows: scale 1
    assert (ks[pg[2], :, rw[2]] == 2.0 ** -126).all()  # the floor
    assert (ks[pg[1], :, rw[1]] > 1).all() and torch.isfinite(ks).all()


@pytest.mark.parametrize("hq,hkv,hd,ps,tiles", [
    (4, 2, 16, 16, (16, 16)),
    (4, 4, 32, 8, (32, 16)),
    (8, 2, 16, 16, (16, 64)),
    (3, 1, 16, 4, (64, 32)),
])
def test_paged_attention_matches_the_reference(hq, hkv, hd, ps, tiles):
    pages = 64 // ps + 8
    batch = PrefillBatch.build(_pieces(ps, pages, 3), ps, "cpu")
    g = torch.Generator().manual_seed(4)
    k = torch.randn(pages, hkv, ps, hd, generator=g).bfloat16()
    v = torch.randn(pages, hkv, ps, hd, generator=g).bfloat16()
    q = torch.randn(batch.num_tokens, hq, hd, generator=g).bfloat16()
    got = paged_attention.paged_prefill_attention(q, k, v, batch, paged_attention.AttentionTiles(*tiles, 4, 1))
    want = torch_attention(q.float(), k.float(), v.float(), batch)
    close(got, want, 3e-2)


def _fp8_pages(pages: int, hkv: int, ps: int, hd: int, g: torch.Generator, used: set[int]):
    """An fp8 layer as ``rope_append`` leaves it: random rows of magnitudes 2^-4 .. 2^4 quantised row by row
    (``fp8.quantize``); pages no sequence uses hold NaN bytes and scales, so reading one poisons the output."""
    x = torch.randn(pages, hkv, ps, hd, generator=g) * 2.0 ** (8 * torch.rand(pages, hkv, ps, 1, generator=g) - 4)
    q, scale = fp8.quantize(x.bfloat16())
    unused = [p for p in range(pages) if p not in used]
    q.view(torch.uint8)[unused] = 0x7F  # e4m3fn NaN
    scale[unused] = float("nan")
    return q, scale


@pytest.mark.parametrize("hq,hkv,hd,ps,tiles,short", [
    (4, 2, 16, 16, (16, 32), False),
    (4, 4, 32, 8, (32, 16), False),
    (3, 1, 16, 4, (64, 32), False),
    (8, 2, 16, 8, (128, 16), True),  # decode tokens and verify blocks: a KV head's query heads in one program
])
def test_paged_attention_dequantises_each_fp8_row_with_its_own_scale(hq, hkv, hd, ps, tiles, short):
    pages = 64 // ps + 8 if not short else sum(-(-(60 + n) // ps) for n in (3, 4, 1)) + 4
    pieces = _pieces(ps, pages, 5) if not short else _short_pieces(ps, pages, (3, 4, 1), 9)
    batch = PrefillBatch.build(pieces, ps, "cpu")
    used = {p for pc in pieces for p in pc.block_table[:-(-pc.ctx // ps)]}
    g = torch.Generator().manual_seed(6)
    (k8, ks), (v8, vs) = _fp8_pages(pages, hkv, ps, hd, g, used), _fp8_pages(pages, hkv, ps, hd, g, used)
    q = torch.randn(batch.num_tokens, hq, hd, generator=g).bfloat16()
    got = paged_attention.paged_prefill_attention(q, k8, v8, batch, paged_attention.AttentionTiles(*tiles, 4, 1),
                                                  ks, vs)
    assert torch.isfinite(got).all()
    want = torch_attention(q.float(), fp8.dequantize(k8, ks), fp8.dequantize(v8, vs), batch)
    # the kernel rounds the dequantised rows, the probabilities and its output to bf16: a few bf16 steps of the
    # largest output (rows span 2^-4 .. 2^4, so a row read with another row's scale is off by far more)
    close(got, want, 1e-2 * want.abs().max().item())


def _short_pieces(page_size: int, num_pages: int, lengths, seed: int):
    """Sequences of contexts 37, 18, 5, ... advanced by ``lengths`` tokens (decode tokens, verify blocks), shuffled
    pages."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pieces, i = [], 0
    for j, n in enumerate(lengths):
        start = (37, 18, 5, 60)[j % 4]
        need = -(-(start + n) // page_size)
        pieces.append(Piece(tuple(perm[i:i + need]), start, n, n))
        i += need
    return pieces


@pytest.mark.parametrize("hq,hkv,lengths", [
    (8, 2, (1, 1, 1, 1)),     # decode tokens: 4 heads x 4 padded tokens = 16 rows a KV head
    (8, 2, (3, 4, 1)),        # verify blocks of up to 4
    (6, 2, (2, 1, 2)),        # a group of 3 heads padded to 4
    (4, 1, (16, 5)),          # 4 heads x 16 tokens = 64 rows
])
def test_paged_attention_groups_a_kv_heads_queries_for_short_pieces(hq, hkv, lengths):
    hd, ps = 16, 8
    group = hq // hkv
    hp, block_m = paged_attention.query_rows(group, max(lengths), 128)
    assert hp > 1 and hp >= group and block_m <= 128  # the grouped mode runs here
    pages = sum(-(-(60 + n) // ps) for n in lengths) + 4
    batch = PrefillBatch.build(_short_pieces(ps, pages, lengths, 7), ps, "cpu")
    g = torch.Generator().manual_seed(8)
    k = torch.randn(pages, hkv, ps, hd, generator=g).bfloat16()
    v = torch.randn(pages, hkv, ps, hd, generator=g).bfloat16()
    q = torch.randn(batch.num_tokens, hq, hd, generator=g).bfloat16()
    got = paged_attention.paged_prefill_attention(q, k, v, batch, paged_attention.AttentionTiles(128, 16, 4, 1))
    want = torch_attention(q.float(), k.float(), v.float(), batch)
    close(got, want, 3e-2)


def test_query_rows_groups_only_what_a_block_fits():
    assert paged_attention.query_rows(4, 1, 128) == (4, 16)
    assert paged_attention.query_rows(4, 16, 128) == (4, 64)
    assert paged_attention.query_rows(3, 5, 128) == (4, 32)
    assert paged_attention.query_rows(4, 64, 128) == (1, 128)  # a prefill chunk: one head a program
    assert paged_attention.query_rows(1, 1, 128) == (1, 128)   # no GQA: nothing to group
