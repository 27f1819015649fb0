"""The megakernel's decode batch (``MegakernelDecoder.step_batch``: B sequences, one token each, in one launch) on a
Hopper GPU against the fp32 reference decoder (marker `gpu`; skipped without CUDA): tools/check.check_batch over 16
steps, poisoned scratch, repeated launches compared bit for bit, the appended K/V rows checked. 40 cases (B = 2..8 on
wgmma N = 8, 13 and 16 on N = 16), ~8-9 minutes on an H100 (the 24 of B <= 8 took 5): `scripts/gpu_check.sh` runs
them as their own part (PARTS=batches). Verify mixes (step_segments) likewise, their blocks as attention's query
blocks. Then the same over an fp8 KV cache (``-k fp8``: a decode batch on the 1B and the 8B, verify blocks at a short
context, their tokens one-token segments), and verify blocks at context 17 over both caches, where a block's rows of
the same launch lie in attention's first blocks (``-k short_context``)."""
import pytest
import torch

from mimw.models.spec import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the megakernel needs a Hopper (sm_90) GPU")]

MODELS = ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"]


@pytest.mark.parametrize("context", [17, 1000])
@pytest.mark.parametrize("batch", [2, 5, 8, 13, 16, 32])
@pytest.mark.parametrize("model", MODELS)
def test_decode_batches_match_reference_over_16_steps(model, batch, context):
    """MegakernelDecoder.step_batch: B sequences (contexts context + 3b, their own shuffled pages) advanced by one
    launch a step (swap-AB wgmma, device/matvec_mt.py; DOWN_PROJ in ticketed parts on the 8B shapes); every
    sequence's logits against the fp32 oracle, repeated launches bit-identical, the appended K/V rows equal to the
    oracle's; each error within 2e-2 (1e-2 for the rows) or twice the bf16 reference's own, whichever is larger;
    argmax the oracle's up to near-ties."""
    from mimw.megakernel.plan import max_tokens
    from mimw.megakernel.tools.check import check_batch

    if batch > max_tokens(get_preset(model)):
        pytest.skip(f"{model} plans at most {max_tokens(get_preset(model))} tokens a step")
    r = check_batch(get_preset(model), batch, context, steps=16)
    assert r.finite, r
    assert r.bit_identical, f"repeated launches differ (race): {r}"
    assert r.max_rel_err <= max(2e-2, 2 * r.bf16_rel_err), r
    assert r.argmax_agree_or_tie >= 0.99, r
    assert r.kv_rel_err <= max(1e-2, 2 * r.bf16_kv_rel_err), r


VERIFY_MIXES = [(4, 3, 1), (8,), (2, 2, 2, 2), (16,), (9, 6, 1)]  # the last two on wgmma N = 16
VERIFY_CASES = ([(v, False, 1000) for v in VERIFY_MIXES] + [((4, 2, 1), True, 1000), ((9, 3), True, 1000)]
                + [((16,), False, 37),  # T = 16 past a context that is no multiple of the K/V blocks: the split
                   # holding the block's own rows reads them, late, in its first blocks
                   ((1, 5, 1, 6), True, 1000),  # two verify blocks and decode tokens, 13 padded to 16
                   ((3, 4), False, 20),  # short contexts: every split's first blocks hold this step's rows
                   ((20, 1), True, 1000),  # a segment past one query block (16 + 4), bucket 32 (1B, SmolLM2)
                   ((1,) * 5, True, 1000),  # a decode batch of 5: three padding rows at position 0 of one page
                   ((2, 1, 2), True, 1000)])  # verify blocks of two token by token, padded as a decode batch


@pytest.mark.parametrize("lens,padded,context", VERIFY_CASES,
                         ids=["x".join(map(str, v)) + ("-padded" if p else "") + f"-ctx{c}"
                              for v, p, c in VERIFY_CASES])
@pytest.mark.parametrize("model", MODELS)
def test_verify_blocks_match_reference_over_8_steps(model, lens, padded, context):
    """MegakernelDecoder.step_segments: verify blocks (every token's logits) mixed with decode tokens, run as
    one-token segments (launch/one_token.py) whose attention takes each verify block as one query block
    (ops/attn_query_block.py: one instruction per block, KV head and split, its tokens x the group's heads on
    mma.sync): a block's token i attends to the rows its tokens 0..i-1 store in the same launch, which attention's
    prefetch must not read before its wait (state.seg_new); padded (7 tokens as the bucket of 8, 12 and 13 as 16,
    21 as 32) by a block on a page of its own (a decode batch of 5 as 8 by three one-token rows
    there). Against the fp32 oracle over the real segments, bounds as above;
    repeated launches bit-identical; every cache row but the appended ones (and the padding's page) unchanged."""
    from mimw.megakernel.launch.one_token import bucket_of
    from mimw.megakernel.plan import max_tokens
    from mimw.megakernel.tools.check import check_segments

    if bucket_of(sum(lens)) > max_tokens(get_preset(model)):
        pytest.skip(f"{model} plans at most {max_tokens(get_preset(model))} tokens a step")
    r = check_segments(get_preset(model), lens, context, steps=8, padded=padded)
    assert r.others_intact, r
    assert r.finite, r
    assert r.bit_identical, f"repeated launches differ (race): {r}"
    assert r.max_rel_err <= max(2e-2, 2 * r.bf16_rel_err), r
    assert r.argmax_agree_or_tie >= 0.99, r
    assert r.kv_rel_err <= max(1e-2, 2 * r.bf16_kv_rel_err), r


# --- an fp8 KV cache (e4m3 + a bf16 scale per (token, KV head), kv/fp8.py) -------------------------------------

def _assert_fp8_ok(r):
    """As above, and the appended rows kv/fp8.py rows (re-quantising their dequantised values gives back their
    bytes and scales) within about one e4m3 step of the oracle's, step by step (tools/check.kv_row_check; the bound
    of test_kernel_gpu.py's fp8 decode checks)."""
    assert r.others_intact, r
    assert r.finite, r
    assert r.bit_identical, f"repeated launches differ (race): {r}"
    assert r.max_rel_err <= max(2e-2, 2 * r.bf16_rel_err), r
    assert r.argmax_agree_or_tie >= 0.99, r
    assert r.kv_rows["requant_exact"], r.kv_rows
    assert r.kv_rel_err <= 0.2, r.kv_rows
    assert r.ok(), r


@pytest.mark.parametrize("model,batch", [("llama-3.2-1b", 8), ("llama-3.1-8b", 16)])
def test_fp8_decode_batches_match_reference_over_the_same_fp8_cache(model, batch):
    """A decode batch over an fp8 cache (wgmma N = 8 on the 1B, head_dim 64: 128-position blocks; N = 16 on the
    8B, head_dim 128: 64-position blocks): the kernel against the fp32 oracle over a copy of that very fp8 cache."""
    from mimw.kv import fp8
    from mimw.megakernel.tools.check import check_batch

    _assert_fp8_ok(check_batch(get_preset(model), batch, 1000, steps=16, kv_dtype=fp8.FP8))


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("model,lens,padded", [("llama-3.2-1b", (4, 3, 1), False), ("llama-3.2-1b", (9, 3), True),
                                               ("llama-3.1-8b", (9, 6, 1), False)],
                         ids=["llama-3.2-1b-4x3x1", "llama-3.2-1b-9x3-padded", "llama-3.1-8b-9x6x1"])
def test_verify_blocks_at_a_short_context_reload_block_zero_after_the_wait(model, lens, padded, kv):
    """Verify blocks at context 17 (one split): a block's later tokens find its earlier tokens' rows, which this
    launch stores, inside their split's first block, which attention prefetches before its dependency wait; the
    prefetch masks them (positions from state.seg_new on) and ``_partial`` reloads them after the wait, with their
    scales over an fp8 cache (ops/attn_partial.py). At context 1000 above they lie past block 0 and take the later
    blocks' loads instead."""
    from mimw.kv.pages import parse_kv_dtype
    from mimw.megakernel.tools.check import check_segments

    r = check_segments(get_preset(model), lens, 17, steps=8, padded=padded, kv_dtype=parse_kv_dtype(kv))
    if kv == "fp8":
        _assert_fp8_ok(r)
    else:
        assert r.ok(), r
