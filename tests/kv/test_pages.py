import pytest
import torch

from mimw.kv import fp8
from mimw.kv.pages import KVLayout, PagedKVCache

L, HKV, HD, PS, P = 2, 3, 8, 4, 6


def _layout(dtype: torch.dtype) -> KVLayout:
    return KVLayout(L, HKV, HD, PS, P, dtype)


def test_fp8_pool_shapes_and_bytes():
    c = PagedKVCache(_layout(fp8.FP8))
    assert c.k.shape == (L, P, HKV, PS, HD) and c.k.dtype == fp8.FP8
    assert c.k_scale.shape == c.v_scale.shape == (L, P, HKV, PS) and c.k_scale.dtype == torch.bfloat16
    k, v, ks, vs = c.page_tensors()  # the e4m3 pools as bytes, then their scales
    assert k.dtype == torch.uint8 and k.data_ptr() == c.k.data_ptr() and ks is c.k_scale and vs is c.v_scale
    assert all(t.shape[1] == P for t in c.page_tensors())  # page axis 1 everywhere
    per_token = 2 * L * HKV * (HD * 1 + 2)
    assert c.layout.bytes_per_token() == per_token and c.layout.bytes_per_page() == PS * per_token
    assert c.nbytes == P * PS * per_token
    bf16 = KVLayout(L, HKV, HD, PS, P, torch.bfloat16)
    assert len(PagedKVCache(bf16).page_tensors()) == 2 and bf16.bytes_per_token() == 2 * L * HKV * HD * 2
    assert c.layout.describe().startswith("fp8 e4m3") and bf16.describe() == "bf16"


def test_bad_element_type_is_refused():
    with pytest.raises(ValueError, match="KV element type"):
        KVLayout(L, HKV, HD, PS, P, torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, fp8.FP8])
def test_write_then_gather_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    c = PagedKVCache(_layout(dtype))
    table = (4, 1, 5)  # positions 0-3 in page 4, 4-7 in page 1, 8-11 in page 5
    k, v = torch.randn(10, HKV, HD, generator=g) * 5, torch.randn(10, HKV, HD, generator=g)
    c.write(1, table, torch.arange(10), k, v)
    kg, vg = c.gather(1, table, 10)
    assert kg.shape == vg.shape == (10, HKV, HD)
    tol = {torch.float32: 0.0, torch.bfloat16: 2 ** -8, fp8.FP8: 2 ** -4}[dtype]
    for got, want in ((kg, k), (vg, v)):
        scale = want.abs().amax(-1, keepdim=True)  # the row's magnitude bounds an element's absolute error
        assert float(((got.float() - want).abs() / scale).max()) <= tol
    # positions land where the block table says: position 5 is row 1 of page 1
    assert torch.equal(c.load("k", 1, torch.tensor([1]), torch.tensor([1])), kg[5:6])
    assert bool((c.k[0].float() == 0).all())  # the other layer is untouched


def test_fp8_rows_are_independent_appending_rescales_nothing():
    c = PagedKVCache(_layout(fp8.FP8))
    table = (2,)
    small = torch.full((1, HKV, HD), 0.01)
    c.write(0, table, torch.tensor([0]), small, small)
    before = [t.clone() for t in c.page_tensors()]
    big = torch.full((1, HKV, HD), 1000.0)
    c.write(0, table, torch.tensor([1]), big, big)  # a much larger row in the same page
    for t, b in zip(c.page_tensors(), before):  # row 0 (bits and scale) as it was
        assert torch.equal(t[:, :, :, 0], b[:, :, :, 0])
    kg, _ = c.gather(0, table, 2)
    assert torch.allclose(kg[0], small, rtol=2 ** -4) and torch.allclose(kg[1], big, rtol=2 ** -4)
    assert c.k_scale[0, 2, 0, 0] == fp8.row_scale(torch.tensor(0.01)) and c.k_scale[0, 2, 0, 1] == 1000 / 448


def test_one_head_store_and_load_match_the_all_heads_form():
    g = torch.Generator().manual_seed(1)
    c = PagedKVCache(_layout(fp8.FP8))
    pages, rows = torch.tensor([3, 3, 0]), torch.tensor([0, 1, 2])
    x = torch.randn(3, HD, generator=g)
    c.store("v", 1, pages, rows, x, head=2)
    assert torch.equal(c.load("v", 1, pages, rows, head=2), c.load("v", 1, pages, rows)[:, 2])
    assert torch.equal(c.load("v", 1, pages, rows, head=2), fp8.dequantize(*fp8.quantize(x)))
    assert bool((c.load("v", 1, pages, rows)[:, :2] == 0).all())


def test_fp8_pages_and_their_scales_survive_a_host_tier_round_trip():
    from mimw.kv.transfer import SyncCopier

    g = torch.Generator().manual_seed(2)
    c = PagedKVCache(_layout(fp8.FP8))
    x = torch.randn(8, HKV, HD, generator=g) * 3
    c.write(1, (4, 0), torch.arange(8), x, -x)
    want = [t[:, [4, 0]].clone() for t in c.page_tensors()]
    host = tuple(torch.zeros((2, t.shape[0], *t.shape[2:]), dtype=t.dtype) for t in c.page_tensors())
    copier = SyncCopier()
    copier.offload(c.page_tensors(), [4, 0], host, [0, 1])
    copier.restore(host, [0, 1], c.page_tensors(), [2, 5])  # into other pages
    for t, w in zip(c.page_tensors(), want):
        assert torch.equal(t[:, [2, 5]], w)
    k, v = c.gather(1, (2, 5), 8)
    assert torch.equal(k, fp8.dequantize(*fp8.quantize(x))) and torch.equal(v, fp8.dequantize(*fp8.quantize(-x)))
