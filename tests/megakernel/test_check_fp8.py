"""tools/check.py's fp8 helpers on the CPU: the random fp8 cache, the row check the GPU tests assert on, and the
row copy that gives the oracles the kernel's rows."""
import torch

from mimw.kv import fp8
from mimw.megakernel.tools.check import copy_cache, copy_rows, kv_row_check, merge_row_checks, random_cache
from mimw.models.spec import get_preset


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
