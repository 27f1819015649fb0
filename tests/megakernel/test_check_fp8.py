"""tools/check.py's fp8 helpers on the CPU: the random fp8 cache, the row check the GPU tests assert on, the row
copy that gives the oracles the kernel's rows, the oracles' caches, and a batch result's verdict over fp8 rows."""
import torch

from mimw.kv import fp8
from mimw.megakernel.tools.check import (BatchResult, as_kv_dtype, copy_cache, copy_rows, kv_row_check,
                                         merge_row_checks, oracles, random_cache)
from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights


def test_the_fp8_check_helpers_catch_a_row_that_is_no_kv_fp8_row_and_copy_rows_back():
    spec = get_preset("tiny-qwen3")
    cache, table = random_cache(spec, 40, 8, 16, 0, device="cpu", kv_dtype=fp8.FP8)
    assert cache.layout.quantized and sorted(table) == list(range(cache.layout.num_pages))
    same = kv_row_check(cache, copy_cache(cache), table, range(0, 48))
    assert same["requant_exact"] and same["max_err"] == 0 and same["bytes_equal"] == 1
    assert same["rows"] == 48 * spec.num_layers * 2 * spec.num_kv_heads
    # a row quantised against the wrong amax (its largest element at 224, not 448): it dequantises to values, but
    # not to a row kv/fp8.py would store for them
    bad = copy_cache(cache)
    page, row = table[41 // 16], 41 % 16
    q = bad.k.view(torch.uint8)[1, page, 0, row].view(fp8.FP8)
    bad.k.view(torch.uint8)[1, page, 0, row] = (q.float() / 2).to(fp8.FP8).view(torch.uint8)
    r = kv_row_check(bad, cache, table, [41])
    assert not r["requant_exact"] and r["max_err"] > 0.4 and r["bytes_equal"] < 1
    assert kv_row_check(bad, cache, table, [40])["requant_exact"]  # other positions untouched
    merged = merge_row_checks(same, r)
    assert not merged["requant_exact"] and merged["max_err"] == r["max_err"]
    assert merged["rows"] == same["rows"] + r["rows"]
    copy_rows(bad, cache, table, [41])
    assert all(torch.equal(a, b) for a, b in zip(bad.page_tensors(), cache.page_tensors()))


def test_the_oracles_read_copies_of_the_very_fp8_cache_and_append_kv_fp8_rows():
    """Over an fp8 cache both references get their own fp8 copy (same bytes and scales, their own memory), whose
    appended rows are kv/fp8.py rows; over a bf16 cache the oracle's copy is fp32, the bf16 reference's bf16."""
    spec = get_preset("tiny-qwen3")
    w = random_weights(spec, 0, dtype=torch.bfloat16)
    cache, table = random_cache(spec, 40, 8, 16, 1, device="cpu", kv_dtype=fp8.FP8)
    before = [t.clone() for t in cache.page_tensors()]
    ref, ref_cache, bf16_ref, bf16_cache = oracles(w, cache)
    for c in (ref_cache, bf16_cache):
        assert c.layout == cache.layout and c.k.data_ptr() != cache.k.data_ptr()
        assert all(torch.equal(a, b) for a, b in zip(c.page_tensors(), cache.page_tensors()))
    seg = [Segment(tuple(table), 40, 1)]
    a = ref.forward(torch.tensor([3]), seg, ref_cache)
    b = bf16_ref.forward(torch.tensor([3]), seg, bf16_cache)
    assert a.shape == b.shape == (1, spec.vocab_size) and bool(torch.isfinite(a).all())
    check = kv_row_check(ref_cache, bf16_cache, table, [40])
    assert check["requant_exact"] and check["max_err"] < 0.2  # kv/fp8.py rows, within an e4m3 step of each other
    assert all(torch.equal(x, y) for x, y in zip(cache.page_tensors(), before))  # the kernel's cache untouched
    plain, _ = random_cache(spec, 40, 8, 16, 1, device="cpu")
    assert as_kv_dtype(plain, torch.bfloat16) is plain
    _, ref32, _, ref16 = oracles(w, plain)
    assert ref32.layout.dtype == torch.float32 and ref16.layout.dtype == torch.bfloat16
    assert torch.equal(ref32.k, plain.k.float()) and torch.equal(ref16.v, plain.v)


def test_a_batch_result_over_fp8_rows_needs_kv_fp8_rows_within_an_e4m3_step():
    fields = dict(model="m", batch=8, context=17, steps=8, max_rel_err=1e-3, argmax_agree=1.0,
                  argmax_agree_or_tie=1.0, bit_identical=True, finite=True, bf16_rel_err=2e-3, bf16_kv_rel_err=0.07)
    rows = {"requant_exact": True, "max_err": 0.07, "bytes_equal": 0.8, "rows": 10}
    assert BatchResult(kv_rel_err=0.07, kv_rows=rows, **fields).ok()
    assert not BatchResult(kv_rel_err=0.07, kv_rows=dict(rows, requant_exact=False), **fields).ok()
    assert not BatchResult(kv_rel_err=0.5, kv_rows=dict(rows, max_err=0.5), **fields).ok()
    # a bf16 cache's rows (no kv_rows): within 1e-2 or twice the bf16 reference's own rows' error
    bf16 = dict(fields, bf16_kv_rel_err=4e-3)
    assert BatchResult(kv_rel_err=9e-3, **bf16).ok() and not BatchResult(kv_rel_err=0.07, **bf16).ok()


def test_a_bf16_rows_error_counts_only_its_positions_and_the_fp32_oracle_takes_the_kernels_rows():
    """The bf16 path of the step-by-step row check: ``row_error`` is relative to the oracle cache's max|value| and
    sees only the positions asked for; ``copy_rows`` widens the kernel's bf16 rows into the oracle's fp32 cache; a
    check result judges a bf16 cache's rows against twice the bf16 reference's own error, or 1e-2."""
    from mimw.megakernel.tools.check import CheckResult, row_error, row_scales

    spec = get_preset("tiny-qwen3")
    cache, table = random_cache(spec, 40, 8, 16, 0, device="cpu")
    w = random_weights(spec, 0, dtype=torch.bfloat16)
    _, ref_cache, _, bf16_cache = oracles(w, cache)
    scales = row_scales(ref_cache)
    assert ref_cache.k.dtype == torch.float32 and row_error(cache, ref_cache, table, range(48), scales) == 0
    page, row = table[41 // 16], 41 % 16
    cache.v[1, page, 0, row, 3] += scales[1] / 8
    assert row_error(cache, ref_cache, table, [40, 42], scales) == 0
    assert abs(row_error(cache, ref_cache, table, [41], scales) - 1 / 8) < 1e-2
    copy_rows(ref_cache, cache, table, [41])
    copy_rows(bf16_cache, cache, table, [41])
    assert row_error(cache, ref_cache, table, range(48), scales) == 0
    assert torch.equal(bf16_cache.v, cache.v) and torch.equal(ref_cache.v, cache.v.float())
    fields = dict(model="m", context=40, steps=8, max_rel_err=1e-3, argmax_agree=1.0, argmax_agree_or_tie=1.0,
                  bit_identical=True, finite=True)
    assert CheckResult(kv_rel_err=8e-3, bf16_kv_rel_err=1e-3, **fields).ok()
    assert CheckResult(kv_rel_err=1.5e-2, bf16_kv_rel_err=1e-2, **fields).ok()
    assert not CheckResult(kv_rel_err=3e-2, bf16_kv_rel_err=1e-2, **fields).ok()
    assert not CheckResult(**fields).ok()  # rows never measured: nan fails
