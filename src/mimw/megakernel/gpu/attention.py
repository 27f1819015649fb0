"""Device code of the attention instructions (ATTN_PARTIAL, ATTN_REDUCE), M = 1: split-KV decode attention over
the paged cache. PyTorch references: ``mimw.megakernel.ops.attn_partial`` / ``attn_reduce``.

Scores are kept in the base-2 domain (q pre-scaled by head_dim^-0.5 * log2(e)) so the online softmax uses exp2;
partials are stored in the natural-log domain of the state.py contract (m * ln 2). K/V rows are read with plain
vectorised loads (16 B per thread) through L2 (.cg): the newest row was written by another CTA in this step.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
EMPTY_M: gl.constexpr = gl.constexpr(-1.0e30)


@gluon.jit
def partial(layer, kvh, seg, split, n_splits, ctx, q_ptr, kc_ptr, vc_ptr, bt_ptr, MAXP, NP, SPLITS,
            po_ptr, pml_ptr, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr, PS: gl.constexpr,
            qscale, BT: gl.constexpr, KL: gl.constexpr):
    G: gl.constexpr = HQ // HKV
    chunk = (ctx + n_splits - 1) // n_splits
    lo = gl.minimum(split * chunk, ctx)
    hi = gl.minimum(lo + chunk, ctx)
    offs_t = gl.arange(0, BT, gl.SliceLayout(1, KL))
    offs_d = gl.arange(0, HD, gl.SliceLayout(0, KL))
    for j in range(G):
        h = kvh * G + j
        q = gl.load(q_ptr + h * HD + offs_d, cache_modifier=".cg") * qscale  # head_dim^-0.5 * log2(e)
        m_i = gl.max(gl.full([BT], EMPTY_M, gl.float32, gl.SliceLayout(1, KL)), axis=0)
        l_i = m_i * 0.0
        o = gl.zeros([HD], gl.float32, gl.SliceLayout(0, KL))
        for t0 in range(lo, hi, BT):
            t = t0 + offs_t
            valid = t < hi
            page = gl.load(bt_ptr + seg * MAXP + t // PS, mask=valid, other=0)
            row = ((layer * NP + page) * HKV + kvh) * PS + t % PS
            addr = gl.expand_dims(row * HD, 1) + gl.expand_dims(offs_d, 0)
            k = gl.load(kc_ptr + addr, mask=gl.expand_dims(valid, 1), other=0.0, cache_modifier=".cg")
            s = gl.sum(k.to(gl.float32) * gl.expand_dims(q, 0), axis=1)
            s = gl.where(valid, s, EMPTY_M)
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new)
            v = gl.load(vc_ptr + addr, mask=gl.expand_dims(valid, 1), other=0.0, cache_modifier=".cg")
            l_i = l_i * alpha + gl.sum(p, axis=0)
            o = o * alpha + gl.sum(gl.expand_dims(p, 1) * v.to(gl.float32), axis=0)
            m_i = m_new
        base = (h * SPLITS + split)
        gl.store(po_ptr + base * HD + offs_d, o)
        gl.store(pml_ptr + base * 2, gl.where(l_i > 0.0, m_i * LN2, EMPTY_M))
        gl.store(pml_ptr + base * 2 + 1, l_i)


@gluon.jit
def reduce(kvh, n_splits, SPLITS, po_ptr, pml_ptr, attn_ptr, HQ: gl.constexpr, HKV: gl.constexpr,
           HD: gl.constexpr, SP2: gl.constexpr, RL: gl.constexpr):
    """attn[h] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s over the splits of each of the G heads."""
    G: gl.constexpr = HQ // HKV
    offs_s = gl.arange(0, SP2, gl.SliceLayout(1, RL))
    offs_d = gl.arange(0, HD, gl.SliceLayout(0, RL))
    valid = offs_s < n_splits
    for j in range(G):
        h = kvh * G + j
        base = h * SPLITS + offs_s
        ms = gl.load(pml_ptr + base * 2, mask=valid, other=EMPTY_M, cache_modifier=".cg")
        ls = gl.load(pml_ptr + base * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
        mx = gl.max(ms, axis=0)
        w = gl.exp2((ms - mx) * LOG2E)
        den = gl.sum(w * ls, axis=0)
        po = gl.load(po_ptr + gl.expand_dims(base * HD, 1) + gl.expand_dims(offs_d, 0),
                     mask=gl.expand_dims(valid, 1), other=0.0, cache_modifier=".cg")
        o = gl.sum(gl.expand_dims(w, 1) * po, axis=0) / den
        gl.store(attn_ptr + h * HD + offs_d, o)
