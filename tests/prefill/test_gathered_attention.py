"""The host side of the ``cudnn`` attention over gathered pages: the key index that packs every piece's K/V end to
end, the log-sum-exp merge of two partial attentions, and the wrapper around a stand-in with cuDNN's documented
semantics (CPU; the kernel itself runs in the GPU tests)."""
import math

import pytest
import torch

from mimw.kv import fp8
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.prefill import PrefillConfig, PrefillRunner
from mimw.prefill.batch import Piece, PrefillBatch
from mimw.prefill.gathered_attention import KeyIndex, gather, merge_partials


def test_key_index_packs_each_pieces_keys_end_to_end():
    ps, pages = 4, 12
    pieces = [Piece((3, 7, 1), 5, 4), Piece((0, 11, 2, 9), 0, 13), Piece((6,), 0, 2)]
    batch = PrefillBatch.build(pieces, ps, "cpu")
    layer = torch.randn(pages, 2, ps, 8)
    idx = KeyIndex.build(batch)
    assert idx.k_start == (0, 9, 22, 24)
    packed = idx.gather(layer, torch.float32)
    assert packed.shape == (24, 2, 8) and packed.is_contiguous()
    for b in range(3):
        want = gather(layer, batch, b).transpose(0, 1)  # [ctx, Hkv, hd]
        assert torch.equal(packed[idx.k_start[b]:idx.k_start[b + 1]], want)
    with pytest.raises(ValueError, match="must hold q's dtype"):  # e.g. fp8 rows without their scales
        idx.gather(layer.to(torch.float8_e4m3fn), torch.bfloat16)
    # an fp8 layer with its rows' scales: each row dequantised (fp32, exact), then rounded to q's dtype, as sdpa's
    # per-piece gather does
    layer8, scale = fp8.quantize(layer * torch.rand(pages, 2, ps, 1) * 8)
    packed8 = idx.gather(layer8, torch.bfloat16, scale)
    assert packed8.dtype == torch.bfloat16 and packed8.shape == (24, 2, 8)
    for b in range(3):
        want = gather(layer8, batch, b, scale).transpose(0, 1).to(torch.bfloat16)
        assert torch.equal(packed8[idx.k_start[b]:idx.k_start[b + 1]], want)


def _attend(q, k, v):
    """q [H, L, d], k/v [H, S, d] -> (softmax(q k^T / sqrt d) v, its natural log-sum-exp [H, L])."""
    s = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_merge_partials_is_attention_over_both_key_sets():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n, 16, generator=g) for n in (5, 40, 40))
    k = k * 3  # peaked softmax: the merge must weigh the halves by their sums, not average them
    whole, _ = _attend(q, k, v)
    o1, l1 = _attend(q, k[:, :23], v[:, :23])
    o2, l2 = _attend(q, k[:, 23:], v[:, 23:])
    torch.testing.assert_close(merge_partials(o1, l1, o2, l2), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merge_partials(o2, l2, o1, l1), whole, rtol=1e-5, atol=1e-5)


def test_cudnn_is_refused_on_the_cpu():
    w = random_weights(get_preset("smollm2-135m").with_(num_layers=1), seed=0)
    with pytest.raises(ValueError, match="runs on CUDA only"):
        PrefillRunner(w, PrefillConfig("cudnn"))


def _fake_cudnn(q, k, v, causal, lse):
    """cuDNN's: [1, H, L, hd] tensors, the top-left causal mask, the natural log-sum-exp [1, H, L, 1]."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, (torch.logsumexp(s, -1)[..., None] if lse else None)


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_cudnn_attention_around_its_kernel_matches_the_reference(monkeypatch, kv):
    """The wrapper (key index, packing, GQA, the prefix merge) around a kernel with cuDNN's documented semantics
    gives the reference's attention: pieces with and without a prefix, several in one pass; over an fp8 cache,
    attention to its rows dequantised with their own scales."""
    from mimw.prefill import gathered_attention as ga

    monkeypatch.setattr(ga, "_cudnn_op", _fake_cudnn)
    ps, pages, hq, hkv, hd = 4, 40, 6, 2, 8
    pieces = [Piece(tuple(range(0, 12)), 30, 9), Piece(tuple(range(12, 20)), 0, 17), Piece((20, 21, 22), 5, 1)]
    batch = PrefillBatch.build(pieces, ps, "cpu")
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(pages, hkv, ps, hd, generator=g), torch.randn(pages, hkv, ps, hd, generator=g)
    q = torch.randn(batch.num_tokens, hq, hd, generator=g)
    scales = (None, None)
    if kv == "fp8":  # rows of magnitudes 2^-4 .. 2^4: a row read with another row's scale is far off
        mag = lambda: 2.0 ** (8 * torch.rand(pages, hkv, ps, 1, generator=g) - 4)
        (k, ks), (v, vs) = fp8.quantize(k * mag()), fp8.quantize(v * mag())
        scales = (ks, vs)
    attend = ga.LibraryAttention(ga.cudnn_attention).plan(batch)
    want = ga.torch_attention(q, k, v, batch, *scales)
    torch.testing.assert_close(attend(q, k, v, *scales), want, rtol=1e-4, atol=1e-4)
