"""PrefillRunner on the CPU (the reference's functions for the elementwise kernels; every attention that runs on
a CPU) against the reference decoder: logits and the K/V it leaves in the cache."""
import pytest
import torch

from mimw.kv import fp8
from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.prefill import FusedWeights, PrefillConfig, PrefillRunner
from mimw.prefill.flex_attention import BLOCK, block_tables_for
from mimw.prefill.batch import Piece, PrefillBatch

PAGE, PAGES = 16, 12


def _case(spec, seed=0):
    """A prefix of 21 tokens already cached for sequence A (shuffled pages); the step continues A with 30 tokens,
    starts B (9 tokens, 3 logit rows) and decodes one token of C (which holds 6)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(PAGES, generator=g).tolist()
    a, b, c = tuple(perm[:4]), tuple(perm[4:5]), tuple(perm[5:6])
    prefix = [Segment(a, 0, 21), Segment(c, 0, 6)]
    step = [Segment(a, 21, 30), Segment(b, 0, 9, num_logits=3), Segment(c, 6, 1)]
    toks = lambda n: torch.randint(spec.vocab_size, (n,), generator=g)
    return prefix, toks(27), step, toks(40)


def _pair(preset: str, attention: str, max_pass: int, kv_dtype: torch.dtype):
    """(spec, the reference decoder, a runner of ``attention`` in passes of ``max_pass`` tokens, two empty caches
    of ``kv_dtype``: the reference's and the runner's) over the same random weights."""
    spec = get_preset(preset)
    w = random_weights(spec, seed=1)
    caches = [PagedKVCache(KVLayout.for_spec(spec, PAGE, PAGES, kv_dtype)) for _ in range(2)]
    return spec, ReferenceDecoder(w), PrefillRunner(w, PrefillConfig(attention, "torch", max_pass)), caches


CASES = [(p, "torch", 7) for p in ("tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3")] + [
    (p, a, n) for p in ("tiny-llama3", "tiny-qwen3") for a, n in (("torch", 16384), ("sdpa", 16), ("flex", 100))]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose on the CPU
@pytest.mark.parametrize("preset,attention,max_pass", CASES)
def test_runner_matches_the_reference_decoder(preset, attention, max_pass):
    spec, ref, run, caches = _pair(preset, attention, max_pass, torch.float32)
    prefix, ptoks, step, stoks = _case(spec)
    ref.forward(ptoks, prefix, caches[0])
    ref.forward(ptoks, prefix, caches[1])
    want = ref.forward(stoks, step, caches[0], last_only=True)
    got = run.forward(stoks, step, caches[1])
    assert got.shape == (5, spec.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-5)


def test_unfused_weights_are_views_of_the_fused_ones():
    spec = get_preset("tiny-qwen2")
    fw = FusedWeights.from_weights(random_weights(spec, seed=2))
    mw = fw.unfused()
    lw, fl = mw.layers[1], fw.layers[1]
    assert lw.wk.data_ptr() == fl.wqkv[spec.q_size:].data_ptr() and lw.wk.is_contiguous()
    assert lw.w_up.data_ptr() == fl.w_gate_up[spec.intermediate_size:].data_ptr()
    assert lw.bv.data_ptr() == fl.bqkv[spec.q_size + spec.kv_size:].data_ptr()
    assert (mw.lm_head is mw.embed) == spec.tie_word_embeddings


def test_attention_tiles_by_head_dim_and_pass_length():
    from mimw.prefill import AttentionTiles

    assert AttentionTiles.for_head_dim(64) == AttentionTiles(128, 128, 4, 3)
    assert AttentionTiles.for_head_dim(128, 16384) == AttentionTiles(256, 64, 8, 3)
    # decode batches and verify blocks: block_m 128, not 256 rows computed for one
    assert AttentionTiles.for_head_dim(128, 1) == AttentionTiles(128, 64, 8, 3)
    assert AttentionTiles.for_head_dim(64, 128) == AttentionTiles(128, 128, 8, 3)


def test_config_refuses_unknown_names():
    with pytest.raises(ValueError, match="attention"):
        PrefillConfig(attention="fa3")
    with pytest.raises(ValueError, match="kernels"):
        PrefillConfig(kernels="cuda")


@pytest.mark.parametrize("pieces", [
    [Piece((0,) * 20, 0, 300)],
    [Piece((0,) * 20, 130, 170), Piece((0,) * 20, 0, 1), Piece((0,) * 20, 250, 60)],
    [Piece((0,) * 20, 5, 40), Piece((0,) * 20, 0, 90), Piece((0,) * 20, 200, 3)],
])
def test_flex_block_mask_covers_every_visible_key_and_full_blocks_are_full(pieces):
    batch = PrefillBatch.build(pieces, 16, "cpu")
    part_n, part_i, full_n, full_i = (x[0, 0] for x in block_tables_for(batch))
    t, s = batch.num_tokens, sum(p.ctx for p in pieces)
    seg_q = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor([p.length for p in pieces]))
    seg_k = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor([p.ctx for p in pieces]))
    pos_k = torch.cat([torch.arange(p.ctx) for p in pieces])
    dense = (seg_q[:, None] == seg_k[None, :]) & (pos_k[None, :] <= batch.positions[:, None])  # [T, S]
    covered = torch.zeros(t, s, dtype=torch.bool)
    for i in range(part_n.numel()):
        rows = slice(i * BLOCK, (i + 1) * BLOCK)
        for j in full_i[i, :full_n[i]].tolist():
            assert dense[rows, j * BLOCK:(j + 1) * BLOCK].all()
            covered[rows, j * BLOCK:(j + 1) * BLOCK] = True
        for j in part_i[i, :part_n[i]].tolist():
            covered[rows, j * BLOCK:(j + 1) * BLOCK] = True
        assert not set(full_i[i, :full_n[i]].tolist()) & set(part_i[i, :part_n[i]].tolist())
    assert not (dense & ~covered).any()


FP8_CASES = [(p, "torch", 7) for p in ("tiny-llama3", "tiny-qwen2", "tiny-qwen3")] + [
    ("tiny-qwen3", "sdpa", 16), ("tiny-llama3", "flex", 100)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("preset,attention,max_pass", FP8_CASES)
def test_runner_over_an_fp8_cache_matches_the_reference_decoder_over_one(preset, attention, max_pass):
    """The runner quantises each K/V row with its own scale (fp8.quantize) and attends to the rows dequantised, as
    the reference decoder does over an fp8 cache: same bytes and scales in the cache, same logits."""
    spec, ref, run, caches = _pair(preset, attention, max_pass, fp8.FP8)
    prefix, ptoks, step, stoks = _case(spec)
    ref.forward(ptoks, prefix, caches[0])
    run.forward(ptoks, prefix, caches[1])  # the runner writes the prefix too: its rows are checked below
    want = ref.forward(stoks, step, caches[0], last_only=True)
    got = run.forward(stoks, step, caches[1])
    assert got.shape == (5, spec.vocab_size)
    # sdpa and flex attend to the dequantised rows rounded to q's dtype (fp32 here: no rounding)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[1].page_tensors(), caches[0].page_tensors()):  # bytes and scales
        # layer 0's rows do not depend on attention: the same bits; past it, fp32 sums in another order (sdpa's,
        # flex's, and the fused projections' on some CPUs' GEMM kernels) move a value across an e4m3 rounding
        # boundary now and then (tiny-qwen3 with torch attention: 1 byte of 36,864 on one machine)
        assert torch.equal(a[0], b[0])
        assert a.ne(b).float().mean() < 1e-2
    assert caches[1].k_scale.ne(1).any()  # the scales were written, not left at their initial 1
