"""Device code of the attention instructions (ATTN_PARTIAL, ATTN_REDUCE), M = 1: split-KV decode attention over
the paged cache, all query heads of a KV group in one pass. PyTorch references: ``mimw.megakernel.ops.attn_partial``
/ ``attn_reduce``.

One pass over K/V serves the G query heads of the group: each [BT, HD] block of K and V is loaded once and used
for the scores of all GP heads (GP = G rounded up to a power of two; padding heads have q = 0 and are never
stored). Each warp owns BT / num_warps consecutive positions of every block and keeps its own online-softmax state,
so every reduction inside the loop stays within a warp; the warps' states merge once at the end. The first block's
past K/V is requested BEFORE the instruction's dependency wait (``prefetch``): it does not depend on this step,
only the newest row (position ``pos``, written by ATTN_IN) does. The blocks hold past positions only
(``split_range``: the last split also holds ``pos``): that split reads the newest row after the wait, in the
round trip of q, and adds it to warp 0's state as one more position before block 0. Later blocks cost one round
trip each (K and V requested together); holding the next block's K/V in registers too would spill, the compute
partition being at its 255-register limit.
Scores are kept in the base-2 domain (q pre-scaled by head_dim^-0.5 * log2(e)) so the online softmax
uses exp2; partials are stored in the natural-log domain of the state.py contract (m * ln 2). K/V rows are read
with 16-byte vector loads through L2 (.cg): the newest row was written by another CTA in this step.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from . import versioned
from .matvec import MAX_PARTS
from .orchestration import globaltimer_after

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
EMPTY_M: gl.constexpr = gl.constexpr(-1.0e30)


@gluon.jit
def _rows(bt_ptr, seg, MAXP, t, hi, layer, NP, kvh, HKV: gl.constexpr, PS: gl.constexpr):
    """Cache row index of positions t (masked past hi) of one KV head: one block-table gather."""
    page = gl.load(bt_ptr + seg * MAXP + t // PS, mask=t < hi, other=0)
    return ((layer * NP + page) * HKV + kvh) * PS + t % PS


@gluon.jit
def _kv(kc_ptr, vc_ptr, row, m, d3, HD: gl.constexpr):
    """K and V rows ``row`` [NW, BTW] (mask m) as [NW, BTW, HD] bf16, both requested before either is used."""
    addr = gl.expand_dims(row, 2) * HD + d3
    m3 = gl.expand_dims(m, 2)
    k = gl.load(kc_ptr + addr, mask=m3, other=0.0, cache_modifier=".cg")
    v = gl.load(vc_ptr + addr, mask=m3, other=0.0, cache_modifier=".cg")
    return k, v


@gluon.jit
def _copy_block(kvbuf, stage, kc_ptr, vc_ptr, row, m, d3, HD: gl.constexpr):
    """``kv_pipeline``: cp.async of one block's K and V rows ``row`` [NW, BTW] (mask ``m``; masked elements are
    zero-filled) into stage ``stage`` of ``kvbuf`` ([4, NW, BTW, HD]: K at 2 stage, V at 2 stage + 1), one commit
    group. Each thread copies, and later reads back in the same layout, only its own elements: no barrier."""
    addr = gl.expand_dims(row, 2) * HD + d3
    m3 = gl.expand_dims(m, 2)  # broadcast along HD by the copy: whole 16-byte vectors
    async_copy.async_copy_global_to_shared(kvbuf.index(2 * stage), kc_ptr + addr, mask=m3, cache_modifier=".cg")
    async_copy.async_copy_global_to_shared(kvbuf.index(2 * stage + 1), vc_ptr + addr, mask=m3, cache_modifier=".cg")
    async_copy.commit_group()


@gluon.jit
def _finish_rows(qkvp_ptr, n_parts, hoff, d, m, layer, pos, bias_ptr, nw_ptr, invf_ptr, eps, NQKV: gl.constexpr,
                 HD: gl.constexpr, HAS_BIAS: gl.constexpr, NORM: gl.constexpr, ROPE: gl.constexpr):
    """isa.QKV_IN_ATTN: the [R, HD] elements ``d`` of heads at offsets ``hoff`` (head * HD, [R, 1]; rows masked
    by ``m``) finished from ATTN_IN's ``n_parts`` parts as matvec.qkv_finish finishes them: parts summed in part
    order, + bias, q/k RMSNorm (``NORM``), RoPE (``ROPE``: element d pairs with its rotate-half partner
    (d + HD/2) % HD, loaded beside it). Reference: ops/attn_in.finish_rows. The step-independent loads go first,
    in flight with the parts'."""
    dp = (d + HD // 2) % HD
    if ROPE:
        inv_f = gl.load(invf_ptr + d % (HD // 2))
    if NORM:
        nw = gl.load(nw_ptr + d).to(gl.float32)
        nwp = gl.load(nw_ptr + dp).to(gl.float32)
    if HAS_BIAS:
        bb = bias_ptr + layer * NQKV * HD + hoff
        bias = gl.load(bb + d, mask=m, other=0.0).to(gl.float32)
        biasp = gl.load(bb + dp, mask=m, other=0.0).to(gl.float32)
    y = gl.load(qkvp_ptr + hoff + d, mask=m, other=0.0, cache_modifier=".cg")
    yp = gl.load(qkvp_ptr + hoff + dp, mask=m, other=0.0, cache_modifier=".cg")
    for p in gl.static_range(1, MAX_PARTS):  # unrolled and masked: every part's loads in flight together
        mp = m & (p < n_parts)
        y += gl.load(qkvp_ptr + p * NQKV * HD + hoff + d, mask=mp, other=0.0, cache_modifier=".cg")
        yp += gl.load(qkvp_ptr + p * NQKV * HD + hoff + dp, mask=mp, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        y += bias
        yp += biasp
    if NORM:
        rs = gl.expand_dims(gl.rsqrt(gl.sum(y * y, axis=1) / HD + eps), 1)
        y = (y * rs).to(gl.bfloat16).to(gl.float32) * nw
        yp = (yp * rs).to(gl.bfloat16).to(gl.float32) * nwp
    if ROPE:
        ang = pos.to(gl.float32) * inv_f
        sgn = gl.where(d < HD // 2, -1.0, 1.0)  # rotate_half: [-y2, y1]
        y = y * gl.cos(ang) + sgn * yp * gl.sin(ang)
    return y


@gluon.jit
def finish_heads(layer, kvh, pos, n_parts, qkvp_ptr, bias_ptr, qn_ptr, kn_ptr, invf_ptr, eps, HQ: gl.constexpr,
                 HKV: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr, HAS_BIAS: gl.constexpr,
                 QK_NORM: gl.constexpr, NW: gl.constexpr, L4: gl.constexpr):
    """isa.QKV_IN_ATTN, after ATTN_PARTIAL's wait: (q [1, GP, HD] of the group's G heads, unscaled; this step's K
    and V rows [1, 1, HD] of KV head ``kvh``; fp32, in ``partial``'s layouts), finished from ATTN_IN's parts
    (``_finish_rows``) in a compact layout (a warp per head, a few elements a thread) and only then spread to the
    attention's replicated layouts: the finish's temporaries stay small beside the prefetched K/V block."""
    G: gl.constexpr = HQ // HKV
    NQKV: gl.constexpr = HQ + 2 * HKV
    F2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
    g = gl.expand_dims(gl.arange(0, GP, gl.SliceLayout(1, F2)), 1)  # [GP, 1]
    d = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, F2)), 0)  # [1, HD]
    q = _finish_rows(qkvp_ptr, n_parts, (kvh * G + g) * HD, d + g * 0, g < G, layer, pos, bias_ptr,
                     qn_ptr + layer * HD, invf_ptr, eps, NQKV, HD, HAS_BIAS, QK_NORM, True)
    one = gl.expand_dims(gl.arange(0, 1, gl.SliceLayout(1, F2)), 1)  # [1, 1]
    k = _finish_rows(qkvp_ptr, n_parts, (HQ + kvh) * HD + one * 0, d, one == 0, layer, pos, bias_ptr,
                     kn_ptr + layer * HD, invf_ptr, eps, NQKV, HD, HAS_BIAS, QK_NORM, True)
    v = _finish_rows(qkvp_ptr, n_parts, (HQ + HKV + kvh) * HD + one * 0, d, one == 0, layer, pos, bias_ptr, kn_ptr,
                     invf_ptr, eps, NQKV, HD, HAS_BIAS, False, False)
    KV3: gl.constexpr = gl.SliceLayout(1, L4)
    Q3: gl.constexpr = gl.SliceLayout(2, L4)
    q = gl.expand_dims(gl.convert_layout(q, gl.SliceLayout(0, Q3)), 0)
    k = gl.expand_dims(gl.convert_layout(k, gl.SliceLayout(0, KV3)), 0)
    v = gl.expand_dims(gl.convert_layout(v, gl.SliceLayout(0, KV3)), 0)
    return q, k, v


@gluon.jit
def _positions(BT: gl.constexpr, NW: gl.constexpr, L2: gl.constexpr):
    """[NW, BTW] offsets w * BTW + j of a block's positions: warp w owns BTW consecutive positions."""
    BTW: gl.constexpr = BT // NW
    w = gl.arange(0, NW, gl.SliceLayout(1, L2))
    j = gl.arange(0, BTW, gl.SliceLayout(0, L2))
    return gl.expand_dims(w, 1) * BTW + gl.expand_dims(j, 0)


@gluon.jit
def split_range(split, n_splits, ctx):
    """state.split_range with one new position (M = 1): the ctx - 1 past positions in chunks, the last split also
    holding position ctx - 1. Returns (lo, hi, the end of the past positions in [lo, hi))."""
    past = ctx - 1
    chunk = (past + n_splits - 1) // n_splits
    lo = gl.minimum(split * chunk, past)
    hp = gl.minimum(lo + chunk, past)
    return lo, gl.where(split == n_splits - 1, ctx, hp), hp


@gluon.jit
def prefetch(layer, kvh, seg, split, n_splits, ctx, pos, kc_ptr, vc_ptr, bt_ptr, MAXP, NP,
             HKV: gl.constexpr, HD: gl.constexpr, PS: gl.constexpr, BT: gl.constexpr, NW: gl.constexpr,
             L4: gl.constexpr):
    """ATTN_PARTIAL, before its dependency wait: the first block's K/V (past positions only; ``pos``, which ATTN_IN
    writes in this step, is never in a block) does not depend on the step, so its round trip overlaps the wait."""
    KV3: gl.constexpr = gl.SliceLayout(1, L4)
    lo, hi, hp = split_range(split, n_splits, ctx)
    t = lo + _positions(BT, NW, gl.SliceLayout(2, KV3))
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, KV3))), 0), 1)
    row = _rows(bt_ptr, seg, MAXP, t, hp, layer, NP, kvh, HKV, PS)
    return _kv(kc_ptr, vc_ptr, row, t < hp, d3, HD)


@gluon.jit
def _block(q4, k, v, valid, m_i, l_i, o, Q3: gl.constexpr):
    """One block of the online softmax, per warp: scores [NW, GP, BTW] (invalid positions masked), then the
    running max m_i, denominator l_i [NW, GP] and output o [NW, GP, HD] are rescaled and updated."""
    s = gl.sum(q4 * gl.expand_dims(k.to(gl.float32), 1), axis=3)
    s = gl.where(valid, s, EMPTY_M)
    m_new = gl.maximum(m_i, gl.max(s, axis=2))
    alpha = gl.exp2(m_i - m_new)
    p = gl.where(valid, gl.exp2(s - gl.expand_dims(m_new, 2)), 0.0)
    l_i = l_i * alpha + gl.sum(p, axis=2)
    pv = gl.sum(gl.expand_dims(p, 3) * gl.expand_dims(v.to(gl.float32), 1), axis=2)
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(2, Q3)), 2) + pv
    return m_new, l_i, o


@gluon.jit
def partial(layer, kvh, seg, split, n_splits, ctx, pos, k, v, q_ptr, kc_ptr, vc_ptr, bt_ptr, MAXP, NP, SPLITS,
            po_ptr, pml_ptr, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr, PS: gl.constexpr,
            qscale, BT: gl.constexpr, GP: gl.constexpr, NW: gl.constexpr, L4: gl.constexpr, ver=0,
            VQ: gl.constexpr = False, fin_q=None, fin_k=None, fin_v=None, tok_page=0, FIN: gl.constexpr = False,
            kvbuf=None, KVP: gl.constexpr = False, TRACE: gl.constexpr = False, ROW1: gl.constexpr = False,
            mbuf=None, AMERGE: gl.constexpr = False):
    """ATTN_PARTIAL after its wait, given ``prefetch``'s first block (k, v). Warp w keeps its own online-softmax
    state over its BTW positions of every block (all reductions inside the block stay within a warp); the NW states
    are merged once at the end. The blocks cover the split's past positions [lo, hp); the split that holds ``pos``
    (the last) reads the new row with q, after the wait (from the cache, page ``tok_page``, where ATTN_IN stored
    it), and adds it to warp 0's state before block 0. ``VQ`` (isa.READS_Q): there was no wait; q and the new row
    are versioned words at ``q_ptr`` ([Hq + 2 Hkv, HD], qkv_finish) and their loads are the wait. ``FIN``
    (isa.QKV_IN_ATTN): q and the new row are ``finish_heads``' (fin_q, fin_k, fin_v), and the split holding ``pos``
    stores the row to the cache for later steps. ``KVP`` (KernelConfig.kv_pipeline): the
    later blocks come through shared memory (``kvbuf``, two stages): blocks 1 and 2 are requested before block 0 is
    computed, block b + 2 as soon as block b is read, the block-table gather one block further ahead. ``TRACE``:
    returns %globaltimer after block 0, after the later blocks and after the partial's stores (trace.py's
    ATTN_PARTIAL phases), each read once the phase's results exist; else (0, 0, 0). ``ROW1``
    (KernelConfig.attn_row): the new row is a one-position block ([NW, GP, 1] scores, warp 0's alone), not a
    masked BT-position one. ``AMERGE`` (KernelConfig.attn_smem_merge): the warps' states are merged through
    ``mbuf`` (the staging buffer, free during ATTN_PARTIAL) with one barrier (``_merge_smem``)."""
    G: gl.constexpr = HQ // HKV
    KV3: gl.constexpr = gl.SliceLayout(1, L4)  # [NW, BTW, HD] K/V block
    Q3: gl.constexpr = gl.SliceLayout(2, L4)  # [NW, GP, HD] queries / outputs (per warp)
    S3: gl.constexpr = gl.SliceLayout(3, L4)  # [NW, GP, BTW] scores
    lo, hi, hp = split_range(split, n_splits, ctx)
    tk = _positions(BT, NW, gl.SliceLayout(2, KV3))
    ts = gl.expand_dims(_positions(BT, NW, gl.SliceLayout(1, S3)), 1)  # [NW, 1, BTW]
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, KV3))), 0), 1)
    # q [NW, GP, HD]: every warp holds the G heads of the group (padding heads load 0 and are never stored)
    g1 = gl.arange(0, GP, gl.SliceLayout(0, gl.SliceLayout(2, Q3)))
    dq = gl.expand_dims(gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, Q3))), 0), 1)
    g3 = gl.expand_dims(gl.expand_dims(g1, 0), 2) + dq * 0  # [1, GP, HD] head index
    if FIN:
        q = fin_q * qscale
    elif VQ:
        q = versioned.wait(q_ptr + (kvh * G + g3) * HD + dq, g3 < G, ver) * qscale
    else:
        q = gl.load(q_ptr + (kvh * G + g3) * HD + dq, mask=g3 < G, other=0.0, cache_modifier=".cg") * qscale
    q4 = gl.expand_dims(q, 2)
    # the newest row (position pos) [1, 1, HD], in flight with q's loads: only the split holding pos reads it
    holds = (lo <= pos) & (pos < hi)
    here = (d3 * 0 + holds.to(gl.int32)) != 0
    at = (((layer * NP + tok_page) * HKV + kvh) * PS + pos % PS) * HD + d3  # the row's place in the cache
    if FIN:  # finished here; the split holding pos also stores it for later steps
        k_new = fin_k.to(gl.bfloat16)
        v_new = fin_v.to(gl.bfloat16)
        gl.store(kc_ptr + at, k_new, mask=here)
        gl.store(vc_ptr + at, v_new, mask=here)
    elif VQ:  # from the finisher's versioned words (zeros, no load, for a split without pos), rounded as cached
        k_new = versioned.wait(q_ptr + (HQ + kvh) * HD + d3, here, ver).to(gl.bfloat16)
        v_new = versioned.wait(q_ptr + (HQ + HKV + kvh) * HD + d3, here, ver).to(gl.bfloat16)
    else:  # from the cache, where ATTN_IN stored it before it signalled
        k_new = gl.load(kc_ptr + at, mask=here, other=0.0, cache_modifier=".cg")
        v_new = gl.load(vc_ptr + at, mask=here, other=0.0, cache_modifier=".cg")
    m_i = gl.full([NW, GP], EMPTY_M, gl.float32, gl.SliceLayout(2, S3))
    l_i = gl.zeros([NW, GP], gl.float32, gl.SliceLayout(2, S3))
    o = gl.zeros([NW, GP, HD], gl.float32, Q3)
    if KVP:  # blocks 1 and 2 in flight while block 0 is computed; the rows of block 3 gathered
        t1 = lo + BT + tk
        _copy_block(kvbuf, 1, kc_ptr, vc_ptr, _rows(bt_ptr, seg, MAXP, t1, hp, layer, NP, kvh, HKV, PS), t1 < hp,
                    d3, HD)
        t2 = lo + 2 * BT + tk
        _copy_block(kvbuf, 0, kc_ptr, vc_ptr, _rows(bt_ptr, seg, MAXP, t2, hp, layer, NP, kvh, HKV, PS), t2 < hp,
                    d3, HD)
        rnext = _rows(bt_ptr, seg, MAXP, lo + 3 * BT + tk, hp, layer, NP, kvh, HKV, PS)
    if holds:  # the newest row first, its loads in q's round trip: one position, warp 0's first (the rest of the
        # block masked). Here its window was 0.6 us shorter than with the row after the blocks (session 19 §1)
        if ROW1:  # as a block one position wide: K and V [1, 1, HD], scores [NW, GP, 1], warp 0's valid
            w0 = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, gl.SliceLayout(2, S3))), 1), 2)
            m_i, l_i, o = _block(q4, k_new.to(gl.float32), v_new.to(gl.float32), w0 == 0, m_i, l_i, o, Q3)
        else:  # a whole block's arithmetic for one position (measured ~0.85 us on the 1B at 46549a9)
            one = gl.zeros([NW, BT // NW, HD], gl.float32, KV3)
            m_i, l_i, o = _block(q4, one + k_new.to(gl.float32), one + v_new.to(gl.float32), ts == 0, m_i, l_i, o,
                                 Q3)
    # block 0 (prefetched), then the rest of the split's past: one round trip per block, or (KVP) pipelined
    m_i, l_i, o = _block(q4, k, v, lo + ts < hp, m_i, l_i, o, Q3)
    t_first = 0
    t_rest = 0
    t_stored = 0
    if TRACE:  # q's round trip and block 0 (its loads issued before the wait)
        t_first = globaltimer_after(_dep(l_i, o))
    for t0 in range(lo + BT, hp, BT):
        t = t0 + tk
        if KVP:
            st = ((t0 - lo) // BT) % 2
            async_copy.wait_group(1)  # this block's group has landed (the next one may still fly)
            k = kvbuf.index(2 * st).load(KV3)
            v = kvbuf.index(2 * st + 1).load(KV3)
            t2 = t + 2 * BT
            _copy_block(kvbuf, st, kc_ptr, vc_ptr, rnext, t2 < hp, d3, HD)
            rnext = _rows(bt_ptr, seg, MAXP, t + 3 * BT, hp, layer, NP, kvh, HKV, PS)
        else:
            row = _rows(bt_ptr, seg, MAXP, t, hp, layer, NP, kvh, HKV, PS)
            k, v = _kv(kc_ptr, vc_ptr, row, t < hp, d3, HD)
        m_i, l_i, o = _block(q4, k, v, t0 + ts < hp, m_i, l_i, o, Q3)
    if KVP:
        async_copy.wait_group(0)  # no copy may land in kvbuf after this instruction
    if TRACE:
        t_rest = globaltimer_after(_dep(l_i, o))
    # merge the warps' states
    if AMERGE:
        mx, l_f, o_f = _merge_smem(m_i, l_i, o, mbuf, GP, HD, NW)
    else:
        mx = gl.max(m_i, axis=0)  # [GP]
        wn = gl.exp2(m_i - gl.expand_dims(mx, 0))
        l_f = gl.sum(l_i * wn, axis=0)
        o_f = gl.sum(o * gl.expand_dims(gl.convert_layout(wn, gl.SliceLayout(2, Q3)), 2), axis=0)  # [GP, HD]
    O2: gl.constexpr = o_f.type.layout
    go = gl.arange(0, GP, gl.SliceLayout(1, O2))
    do = gl.arange(0, HD, gl.SliceLayout(0, O2))
    base = (kvh * G + go) * SPLITS + split
    gl.store(po_ptr + gl.expand_dims(base * HD, 1) + gl.expand_dims(do, 0), o_f, mask=gl.expand_dims(go < G, 1))
    gs = gl.arange(0, GP, mx.type.layout)
    sbase = (kvh * G + gs) * SPLITS + split
    gl.store(pml_ptr + sbase * 2, gl.where(l_f > 0.0, mx * LN2, EMPTY_M), mask=gs < G)
    gl.store(pml_ptr + sbase * 2 + 1, l_f, mask=gs < G)
    if TRACE:
        t_stored = globaltimer_after(_dep(l_f))
    return t_first, t_rest, t_stored


@gluon.jit
def _merge_smem(m_i, l_i, o, mbuf, GP: gl.constexpr, HD: gl.constexpr, NW: gl.constexpr):
    """KernelConfig.attn_smem_merge: the NW warps' online-softmax states (m_i, l_i [NW, GP], o [NW, GP, HD]) merged
    through shared memory: each warp writes its state to ``mbuf`` (the staging buffer read as fp32: o, then m,
    then l), one partition barrier, and each thread reads the NW states of its own [GP, HD] elements (``MG``: the
    warp axis inside each thread, warps over the heads, lanes over HD) and merges them with no further exchange;
    returns (mx, l_f) [GP] and o_f [GP, HD]. Triton's reductions over the warp axis took 9 partition barriers (session 22:
    1.6 us on the 1B, 2.6 on the 8B). The caller's barrier at the instruction's end orders these reads before the
    next instruction's staging writes. Reference: ops/attn_partial (the warps are splits of the split)."""
    gl.static_assert(mbuf.type.shape[0] * mbuf.type.shape[1] * 2 >= NW * GP * (HD + 2) * 4,
                     "the staging buffer must hold the warps' attention states")
    ROWS: gl.constexpr = mbuf.type.shape[0] * mbuf.type.shape[1] * 2 // (GP * HD * 4)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    so = mbuf._reinterpret(gl.float32, [ROWS, GP, HD], FLAT).slice(0, NW)
    sm = mbuf._reinterpret(gl.float32, [ROWS * HD, GP, 1], FLAT).slice(NW * HD, NW)  # [NW, GP, 1] past o
    sl = mbuf._reinterpret(gl.float32, [ROWS * HD, GP, 1], FLAT).slice(NW * HD + NW, NW)
    so.store(o)
    sm.store(gl.expand_dims(m_i, 2))
    sl.store(gl.expand_dims(l_i, 2))
    gl.thread_barrier()
    MG: gl.constexpr = gl.BlockedLayout([NW, 1, 2 if HD >= 64 else 1], [1, 1, 32], [1, NW, 1], [2, 1, 0])
    m = gl.sum(sm.load(MG), axis=2)  # [NW, GP] in SliceLayout(2, MG): the trailing axis is one wide
    l = gl.sum(sl.load(MG), axis=2)
    ow = so.load(MG)
    mx = gl.max(m, axis=0)  # [GP]: the warp axis inside each thread
    wn = gl.exp2(m - gl.expand_dims(mx, 0))
    l_f = gl.sum(l * wn, axis=0)
    o_f = gl.sum(ow * gl.expand_dims(wn, 2), axis=0)  # [GP, HD]
    return mx, l_f, o_f


@gluon.jit
def _dep(x, y=None):
    """An int32 scalar that exists only once every element of ``x`` ([A] or [A, B] fp32) does, and of ``y``
    ([A, B, C] fp32: the block's P V, which the softmax sums alone do not wait for) if given (for
    ``globaltimer_after``)."""
    if len(x.shape) == 2:
        x = gl.sum(x, axis=1)
    s = gl.sum(x, axis=0)
    if y is not None:
        s += gl.sum(gl.sum(gl.sum(y, axis=2), axis=1), axis=0) * 0.0  # a data dependency, not a value
    return s.to(gl.int32, bitcast=True)


@gluon.jit
def _combine(kvh, n_splits, SPLITS, po_ptr, pml_ptr, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr,
             SP2: gl.constexpr, GP: gl.constexpr, R3: gl.constexpr):
    """The G heads of KV group ``kvh`` combined over splits [0, n_splits): attn[h] = sum_s e^(m_s - M) o_s /
    sum_s e^(m_s - M) l_s, [GP, HD] fp32 in SliceLayout(1, R3) (padding heads 0); every partial is loaded in one
    round of independent loads. Reference: ops/attn_reduce.combine."""
    G: gl.constexpr = HQ // HKV
    GS: gl.constexpr = gl.SliceLayout(2, R3)  # [GP, SP2]
    GD: gl.constexpr = gl.SliceLayout(1, R3)  # [GP, HD]
    offs_g = gl.arange(0, GP, gl.SliceLayout(1, GS))
    offs_s = gl.arange(0, SP2, gl.SliceLayout(0, GS))
    base = gl.expand_dims((kvh * G + offs_g) * SPLITS, 1) + gl.expand_dims(offs_s, 0)  # [GP, SP2]
    valid = gl.expand_dims(offs_g < G, 1) & gl.expand_dims(offs_s < n_splits, 0)
    ms = gl.load(pml_ptr + base * 2, mask=valid, other=EMPTY_M, cache_modifier=".cg")
    ls = gl.load(pml_ptr + base * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
    offs_d = gl.arange(0, HD, gl.SliceLayout(0, GD))
    d3 = gl.expand_dims(gl.expand_dims(offs_d, 0), 1)  # [1, 1, HD]
    po = gl.load(po_ptr + gl.expand_dims(base * HD, 2) + d3, mask=gl.expand_dims(valid, 2), other=0.0,
                 cache_modifier=".cg")  # [GP, SP2, HD]
    mx = gl.max(ms, axis=1)
    w = gl.exp2((ms - gl.expand_dims(mx, 1)) * LOG2E)
    den = gl.sum(w * ls, axis=1)
    o = gl.sum(gl.expand_dims(w, 2) * po, axis=1)  # [GP, HD]
    return o / gl.expand_dims(gl.convert_layout(den, gl.SliceLayout(1, GD)), 1)


@gluon.jit
def reduce(kvh, n_splits, SPLITS, po_ptr, pml_ptr, attn_ptr, HQ: gl.constexpr, HKV: gl.constexpr,
           HD: gl.constexpr, SP2: gl.constexpr, GP: gl.constexpr, R3: gl.constexpr, ver=0,
           VERSIONED: gl.constexpr = False):
    """ATTN_REDUCE (or the combining split): the group's combined heads (``_combine``) stored to attn.
    ``VERSIONED``: attn is versioned words (version ``ver``, versioned.py)."""
    G: gl.constexpr = HQ // HKV
    GD: gl.constexpr = gl.SliceLayout(1, R3)  # [GP, HD]
    o = _combine(kvh, n_splits, SPLITS, po_ptr, pml_ptr, HQ, HKV, HD, SP2, GP, R3)
    offs_d = gl.arange(0, HD, gl.SliceLayout(0, GD))
    offs_og = gl.arange(0, GP, gl.SliceLayout(1, GD))
    out = attn_ptr + gl.expand_dims((kvh * G + offs_og) * HD, 1) + gl.expand_dims(offs_d, 0)
    keep = gl.expand_dims(offs_og < G, 1) & gl.expand_dims(offs_d >= 0, 0)  # [GP, HD]
    if VERSIONED:
        versioned.store_masked(out, o, ver, keep)
    else:
        gl.store(out, o, mask=keep)


@gluon.jit
def stage_groups(hbuf, g0, n_splits, SPLITS, po_ptr, pml_ptr, HQ: gl.constexpr, HKV: gl.constexpr,
                 HD: gl.constexpr, SP2: gl.constexpr, GP: gl.constexpr, R3: gl.constexpr, OG: gl.constexpr):
    """O_PROJ in column parts (KernelConfig.o_parts): KV groups g0 .. g0 + OG - 1 combined from their splits
    (``_combine``) and staged, rounded to bf16 as ``matvec.stage_plain`` rounds attn, at their own columns of
    ``hbuf`` (group g's G heads are columns [g G HD, (g + 1) G HD); G is a power of two, KernelConfig.check).
    Reference: ops/o_proj (parts)."""
    NGR: gl.constexpr = hbuf.type.shape[0] * hbuf.type.shape[1] // (GP * HD)
    # rank-2 layout of a rank-3 shape (as hbuf's): groups are indexed at run time
    groups = hbuf._reinterpret(gl.bfloat16, [NGR, GP, HD], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    for j in gl.static_range(OG):
        o = _combine(g0 + j, n_splits, SPLITS, po_ptr, pml_ptr, HQ, HKV, HD, SP2, GP, R3)
        groups.index(g0 + j).store(o.to(gl.bfloat16))
    gl.thread_barrier()  # staged vector visible to every compute warp before the first row tile reads it
