"""CPU: the tensor-core ring walk's tiling (ops/attn_ring_mma.py) in its PyTorch emulation against the attention it
stands for: the relabelled operands, the per-warp online softmax over slots, the fp8 scales and the masks of a
split's partial first and last slots, merged over the warps as attn_partial merges them."""
import math

import pytest
import torch

from mimw.kv import fp8
from mimw.megakernel.ops.attn_ring_mma import emulate, k_relabel, v_relabel
from mimw.megakernel.state import EMPTY_M


@pytest.mark.parametrize("hd", [32, 64, 128])
def test_a_threads_fragment_is_one_run_of_a_row(hd):
    """The operand loads' premise: lane c of a quad holds K's elements [c HD/4, (c+1) HD/4) of a row (its columns 16 s +
    8 h + 2 c + e), and lane g of V^T's rows 16 i + 8 h + g holds a position's [g HD/8, (g+1) HD/8)."""
    kr, vr = k_relabel(hd), v_relabel(hd)
    assert sorted(kr.tolist()) == list(range(hd)) and sorted(vr.tolist()) == list(range(hd))
    for c in range(4):
        cols = [16 * s + 8 * h + 2 * c + e for s in range(hd // 16) for h in range(2) for e in range(2)]
        assert sorted(kr[cols].tolist()) == list(range(c * hd // 4, (c + 1) * hd // 4))
    for g in range(8):
        rows = [16 * i + 8 * h + g for i in range(hd // 16) for h in range(2)]
        assert sorted(vr[rows].tolist()) == list(range(g * hd // 8, (g + 1) * hd // 8))


def _merge(m, l, o):
    """The warps' states (m, l [NW, G] base 2, o [NW, G, HD]) merged: the split's attention [G, HD]."""
    mx = m.amax(0)
    w = torch.exp2(m - mx)
    return (w[..., None] * o).sum(0) / (w * l).sum(0)[:, None]


@pytest.mark.parametrize("kv,hd,g,kvs", [("bf16", 64, 4, 64), ("fp8", 64, 4, 128), ("fp8", 64, 3, 128),
                                         ("fp8", 128, 4, 64), ("bf16", 64, 8, 64), ("bf16", 32, 4, 128),
                                         ("fp8", 32, 4, 256)])
@pytest.mark.parametrize("span", [(0, 1), (3, 130), (5, 300), (64, 192), (17, 17 + 511)])
def test_the_emulated_walk_is_the_splits_attention(kv, hd, g, kvs, span):
    """Random q, K, V over a split [lo, hp) whose slots start at a0 = lo rounded down to a box of 16 rows; the rows
    outside the split hold poison (NaN, inf) that the masks must keep out; 4 warps."""
    nw, box = 4, 16
    lo, hp = span
    a0 = lo // box * box
    n = -(-(hp - a0) // kvs)
    rows = n * kvs
    gen = torch.Generator().manual_seed(hash((kv, hd, g, kvs, span)) % 2**31)
    q = torch.randn(g, hd, generator=gen) * 2.0
    k = torch.randn(rows, hd, generator=gen) * 2.0
    v = torch.randn(rows, hd, generator=gen)
    pos = torch.arange(a0, a0 + rows)
    valid = (pos >= lo) & (pos < hp)
    ks = vs = None
    if kv == "fp8":
        k8, ks = fp8.quantize(k)
        v8, vs = fp8.quantize(v)
        k_true, v_true = fp8.dequantize(k8, ks), fp8.dequantize(v8, vs)
        k_in, v_in = k8.float(), v8.float()
        ks, vs = ks.clone(), vs.clone()
        ks[~valid], vs[~valid] = float("inf"), float("nan")
    else:
        k_true, v_true = k.bfloat16().float(), v.bfloat16().float()
        k_in, v_in = k_true.clone(), v_true.clone()
    k_in[~valid], v_in[~valid] = float("nan"), float("nan")
    qs = q * hd ** -0.5 * math.log2(math.e)
    m, l, o = emulate(qs, k_in, v_in, ks, vs, valid, nw, kvs)
    assert torch.isfinite(o).all() and torch.isfinite(l).all()
    out = _merge(m, l, o).double()

    def attention(q):
        return torch.softmax((q.double() @ k_true[valid].double().t()) * hd ** -0.5, -1) @ v_true[valid].double()

    # against the split's attention with q as the device rounds it (to the operand type, pre-scaled): P's rounding
    # and the fp32 sums only (over 3600 draws at most 1.7e-3 of max|out| over bf16, 5e-4 over fp8); against the
    # exact q, q's rounding too (at most 1.7e-2 and 2.3e-3)
    mt = torch.float16 if kv == "fp8" else torch.bfloat16
    ref = attention(qs.to(mt).double() / (hd ** -0.5 * math.log2(math.e)))
    tol = 4e-3 if kv == "bf16" else 1.5e-3
    assert (out - ref).abs().max() <= tol * ref.abs().max(), (out - ref).abs().max()
    ref = attention(q)
    assert (out - ref).abs().max() <= 10 * tol * ref.abs().max(), (out - ref).abs().max()
    # warps with no position of the split keep the empty state, which the merge weighs 0
    live = valid.reshape(n, nw, kvs // nw).any(0).any(1)
    assert (m[~live] == EMPTY_M).all() and (l[~live] == 0).all()
