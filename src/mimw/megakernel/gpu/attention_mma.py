"""ATTN_PARTIAL on the tensor cores (``KernelConfig.attn_mma``, opt-in): the same split-KV decode attention as
``attention.partial`` (PyTorch reference: ``mimw.megakernel.ops.attn_partial``), with both products of a block on
mma.sync instead of per-thread FMAs and shuffle reductions.

Why: at context 8192 a split's seven extra 64-position blocks cost the 1B ~9 us a layer, ~1.2 us a block, and
streaming them through shared memory (``kv_pipeline``) took only 1.8% of it, so the block is bound by its
arithmetic, not its loads: ``attention._block`` keeps every (head, position, dimension) product in registers of
one thread at a time and reduces over HD and the block by shuffles, a long dependent chain for 4 warps
(bench/NOTES.md, session 14).

Per block of BT positions, all NW warps together (warps split the N dimension of both products):
    S [16, BT] = Q [16, HD] . K^T [HD, BT]       the G heads padded to the 16 rows of an mma tile
    online softmax over S's rows (row max and sum across the warps), P = exp2(S - m) rounded to bf16
    O [16, HD] = O * alpha + P [16, BT] . V [BT, HD]
K^T is loaded straight from the cache in the B-operand layout (consecutive head dimensions of a position are
contiguous in the cache, as the operand wants them); V is loaded in 16-byte vectors and converted. q and P go to
the tensor cores as bf16 (the fp32 path keeps q in fp32): bf16 rounding of the attention's operands, as in
transformers' bf16 attention. The state is one (m, l, O) per head for the whole CTA, so there is no merge of
per-warp states at the end. Scores are in the base-2 domain (q pre-scaled by hd^-0.5 * log2 e) like
``attention.partial``, and the partials are stored in the same format (natural-log m).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.runtime.jit import constexpr_function

from .attention import EMPTY_M, LN2, _rows, split_range

ROWS: gl.constexpr = gl.constexpr(16)  # an mma tile's rows: the group's heads, padded


@constexpr_function
def _acc_layout(NW):
    """S [16, BT] and O [16, HD]: mma.sync accumulators, the NW warps side by side along N."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])


@constexpr_function
def _operand(index, NW):
    """Operand ``index`` (0: A, 1: B) of an mma.sync into ``_acc_layout(NW)``, bf16 pairs along K."""
    return gl.DotOperandLayout(operand_index=index, parent=_acc_layout(NW), k_width=2)


@constexpr_function
def _v_layout(HD, NW):
    """V [BT, HD] as loaded: 16-byte vectors along HD, a warp's lanes across HD first."""
    tpd = 32 if HD // 8 > 32 else HD // 8
    return gl.BlockedLayout([1, 8], [32 // tpd, tpd], [NW, 1], [1, 0])


@gluon.jit
def _block_kv(kc_ptr, vc_ptr, row_k, row_v, m_k, m_v, HD: gl.constexpr, BT: gl.constexpr, NW: gl.constexpr):
    """One block's K^T [HD, BT] in the B-operand layout of S = Q K^T, and V [BT, HD] in 16-byte vectors, from cache
    rows ``row_k`` / ``row_v`` (the same rows in the two layouts' position slices; masked positions load 0)."""
    KB: gl.constexpr = _operand(1, NW)
    VL: gl.constexpr = _v_layout(HD, NW)
    dk = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(1, KB)), 1)
    kt = gl.load(kc_ptr + gl.expand_dims(row_k, 0) * HD + dk, mask=gl.expand_dims(m_k, 0) & (dk >= 0), other=0.0,
                 cache_modifier=".cg")
    dv = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, VL)), 0)
    v = gl.load(vc_ptr + gl.expand_dims(row_v, 1) * HD + dv, mask=gl.expand_dims(m_v, 1) & (dv >= 0), other=0.0,
                cache_modifier=".cg")
    return kt, v


@gluon.jit
def _positions2(lo, BT: gl.constexpr, HD: gl.constexpr, NW: gl.constexpr):
    """Positions lo .. lo + BT - 1 in the position slices of K^T's operand layout and of V's load layout."""
    tk = lo + gl.arange(0, BT, gl.SliceLayout(0, _operand(1, NW)))
    return tk, lo + gl.arange(0, BT, gl.SliceLayout(1, _v_layout(HD, NW)))


@gluon.jit
def prefetch(layer, kvh, seg, split, n_splits, ctx, pos, kc_ptr, vc_ptr, bt_ptr, MAXP, NP, HKV: gl.constexpr,
             HD: gl.constexpr, PS: gl.constexpr, BT: gl.constexpr, NW: gl.constexpr):
    """``attention.prefetch`` for the tensor-core split: block 0's past K^T and V (not position ``pos``), requested
    before the dependency wait; also their cache rows, for the newest row's reload after it."""
    lo, hi = split_range(split, n_splits, ctx)
    tk, tv = _positions2(lo, BT, HD, NW)
    rk = _rows(bt_ptr, seg, MAXP, tk, hi, layer, NP, kvh, HKV, PS)
    rv = _rows(bt_ptr, seg, MAXP, tv, hi, layer, NP, kvh, HKV, PS)
    kt, v = _block_kv(kc_ptr, vc_ptr, rk, rv, (tk < hi) & (tk != pos), (tv < hi) & (tv != pos), HD, BT, NW)
    return kt, v, rk, rv


@gluon.jit
def _step(q, kt, v, t0, hi, m_i, l_i, o, BT: gl.constexpr, HD: gl.constexpr, NW: gl.constexpr):
    """One block of the online softmax for all the heads at once: S = Q K^T on the tensor cores, masked past
    ``hi``, the running max / sum updated, O rescaled and P V added on the tensor cores."""
    SL: gl.constexpr = _acc_layout(NW)
    s = mma_v2(q, kt, gl.zeros([ROWS, BT], gl.float32, SL))
    valid = gl.expand_dims(t0 + gl.arange(0, BT, gl.SliceLayout(0, SL)) < hi, 0)
    s = gl.where(valid, s, EMPTY_M)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.where(valid, gl.exp2(s - gl.expand_dims(m_new, 1)), 0.0)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    o = mma_v2(gl.convert_layout(p.to(gl.bfloat16), _operand(0, NW)), gl.convert_layout(v, _operand(1, NW)),
               o * gl.expand_dims(alpha, 1))
    return m_new, l_i, o


@gluon.jit
def partial(layer, kvh, seg, split, n_splits, ctx, pos, kt, v, rk, rv, q_ptr, kc_ptr, vc_ptr, bt_ptr, MAXP, NP,
            SPLITS, po_ptr, pml_ptr, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr, PS: gl.constexpr,
            qscale, BT: gl.constexpr, NW: gl.constexpr):
    """ATTN_PARTIAL after its wait, given ``prefetch``'s block 0 (K^T, V) and its rows: q (one round trip, with the
    newest row's reload), then every block of the split through ``_step``, then the partial (o, m, l) of the G heads
    stored in ``attention.partial``'s format."""
    G: gl.constexpr = HQ // HKV
    SL: gl.constexpr = _acc_layout(NW)
    QA: gl.constexpr = _operand(0, NW)
    lo, hi = split_range(split, n_splits, ctx)
    gq = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(1, QA)), 1)
    dq = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, QA)), 0)
    q = gl.load(q_ptr + (kvh * G + gq) * HD + dq, mask=(gq < G) & (dq >= 0), other=0.0, cache_modifier=".cg")
    q = (q * qscale).to(gl.bfloat16)
    # the newest row (position pos, written by ATTN_IN after the prefetch) reloaded at the prefetched rows
    tk, tv = _positions2(lo, BT, HD, NW)
    dk = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(1, kt.type.layout)), 1)
    kt = gl.load(kc_ptr + gl.expand_dims(rk, 0) * HD + dk, mask=gl.expand_dims((tk < hi) & (tk == pos), 0) & (dk >= 0),
                 other=kt, cache_modifier=".cg")
    dv = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, v.type.layout)), 0)
    v = gl.load(vc_ptr + gl.expand_dims(rv, 1) * HD + dv, mask=gl.expand_dims((tv < hi) & (tv == pos), 1) & (dv >= 0),
                other=v, cache_modifier=".cg")
    m_i = gl.full([ROWS], EMPTY_M, gl.float32, gl.SliceLayout(1, SL))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, SL))
    o = gl.zeros([ROWS, HD], gl.float32, SL)
    m_i, l_i, o = _step(q, kt, v, lo, hi, m_i, l_i, o, BT, HD, NW)
    for t0 in range(lo + BT, hi, BT):  # the later blocks (this step's position may be in any of them)
        tk, tv = _positions2(t0, BT, HD, NW)
        rk = _rows(bt_ptr, seg, MAXP, tk, hi, layer, NP, kvh, HKV, PS)
        rv = _rows(bt_ptr, seg, MAXP, tv, hi, layer, NP, kvh, HKV, PS)
        kt, v = _block_kv(kc_ptr, vc_ptr, rk, rv, tk < hi, tv < hi, HD, BT, NW)
        m_i, l_i, o = _step(q, kt, v, t0, hi, m_i, l_i, o, BT, HD, NW)
    # partials of the G real heads: o [HD] per head, (m in the natural-log domain, l); empty: (EMPTY_M, 0, 0)
    g = gl.arange(0, ROWS, gl.SliceLayout(1, SL))
    d = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, SL)), 0)
    base = (kvh * G + g) * SPLITS + split
    gl.store(po_ptr + gl.expand_dims(base * HD, 1) + d, o, mask=gl.expand_dims(g < G, 1) & (d >= 0))
    gl.store(pml_ptr + base * 2, gl.where(l_i > 0.0, m_i * LN2, EMPTY_M), mask=g < G)
    gl.store(pml_ptr + base * 2 + 1, l_i, mask=g < G)
