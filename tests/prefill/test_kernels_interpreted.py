"""The prefill Triton kernels against their PyTorch references, run by Triton's interpreter on the CPU at small
shapes. Collected everywhere, run only in the TRITON_INTERPRET=1 process that ``test_interpreter.py`` starts."""
import pytest
import torch
import triton
from interpret import interpreter_fixes

from mimw.models import rope
from mimw.models.spec import get_preset
from mimw.prefill import activation, norm, paged_attention, rope_append
from mimw.prefill.batch import Piece, PrefillBatch
from mimw.prefill.gathered_attention import torch_attention

pytestmark = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                                reason="runs in its own TRITON_INTERPRET=1 process (test_interpreter.py)")


@pytest.fixture(autouse=True)
def _fixes():
    with interpreter_fixes():
        yield


def close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, err


@pytest.mark.parametrize("t,d", [(1, 64), (5, 100)])
def test_rms_norm(t, d):
    g = torch.Generator().manual_seed(t)
    x = (3 * torch.randn(t, d, generator=g)).bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    want = norm.rms_norm_torch(x, w, 1e-5)
    # the interpreter's fp32 -> bf16 cast truncates (the GPU's rounds): up to one bf16 step per rounding
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
    # a few truncating casts (head norm, weight, RoPE) on values of a few units: ~3 bf16 steps; a wrong pairing or
    # position would be off by O(1)
    close(q1, q2, 0.06)
    close(k1, k2, 0.06)
    assert torch.equal(v1, v2)
    written = torch.zeros(pages * ps, dtype=torch.bool)
    written[batch.slots] = True
    untouched = ~written.view(pages, ps)[:, None, :, None].expand_as(k1)
    assert torch.equal(k1[untouched], caches[0][untouched]) and torch.equal(v1[untouched], caches[1][untouched])


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


def test_paged_attention_dequantises_an_fp8_cache():
    hq, hkv, hd, ps, pages = 4, 2, 16, 16, 8
    batch = PrefillBatch.build(_pieces(ps, pages, 5), ps, "cpu")
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(pages, hkv, ps, hd, generator=g), torch.randn(pages, hkv, ps, hd, generator=g)
    ks, vs = torch.rand(pages, hkv, generator=g) + 0.5, torch.rand(pages, hkv, generator=g) + 0.5
    k8 = (k / ks[..., None, None]).to(torch.float8_e4m3fn)
    v8 = (v / vs[..., None, None]).to(torch.float8_e4m3fn)
    q = torch.randn(batch.num_tokens, hq, hd, generator=g).bfloat16()
    got = paged_attention.paged_prefill_attention(q, k8, v8, batch, paged_attention.AttentionTiles(16, 32, 4, 1),
                                                  ks, vs)
    want = torch_attention(q.float(), k8.float() * ks[..., None, None], v8.float() * vs[..., None, None], batch)
    close(got, want, 3e-2)


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
