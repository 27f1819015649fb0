"""ATTN_PARTIAL's one-token ring walk on the tensor cores (``Constants.ATTN_MMA``: plan.py derives it where a ring
slot holds 16 positions a warp or more, ``applies``; a slot of fewer, the 8B's 32 bf16 positions, takes the lanes'
walk on the CUDA cores, attn_partial._partial_ring). Its meaning and PyTorch reference are ATTN_PARTIAL's
(attn_partial.solve); this is the device code attn_partial._partial_ring_mma runs, and ``emulate`` is the same
tiling in PyTorch for the CPU tests.

A one-token step's attention is bound by the compute warps' work a position (the q.k products of the group's heads,
the softmax, the p.v products), not by its bytes; here both products run on mma.sync m16n8k16 (fp32 accumulate):

    slot rows [w PW, (w + 1) PW) are warp w's (PW = KVS / NW positions, a multiple of 16)
    S^T [PW, N] = K [PW, HD] q^T [HD, N]        positions as M, the group's heads as N (GP padded to N = 8)
    per warp and head: m = max(m, max_rows S^T), alpha = 2^(m_old - m), P = 2^(S^T - m), l = l alpha + P
    O^T [HD, N] = O^T alpha + V^T [HD, PW] P [PW, N]

Every warp keeps its own state (m per head, l per element, O^T) over its rows of every slot, so the only reductions
in the loop are a warp's (shuffles); the warps' states merge once a split, as the lanes' do. An fp8 slot's e4m3 rows
widen to f16 (exact; one cvt a pair) and the products run in f16 (q rounded to f16); a bf16 slot's run in bf16 (q
rounded to bf16, as the query blocks' do). The per-position scales of an fp8 slot scale the scores (K's) and the
probabilities that weight V (V's) as the lanes' walk applies them, V's divided by the largest of the warp's scales
in the slot (``cs``), so the f16 probabilities stay in [0, 1]; O^T carries that divisor, rescaled with alpha.

Operand loads straight from the slot's unswizzled rows (the TMA boxes' byte order), with no ldmatrix (eight rows at
a 64- or 128-byte stride hit the same banks): the contraction index of each product is relabelled so that a
thread's fragment is a run of one row. K's head_dim index: fragment column k = 16 s + 8 h + 2 c + e (lane c = lane
% 4) reads element d = (HD/4) c + 4 s + 2 h + e, a thread's HD/4 contiguous elements of a row (one 16-byte load at
fp8 and head_dim 64, conflict-free); q^T takes the same relabelling. V^T's rows (O^T's head_dim index): fragment row
16 i + 8 h + g (g = lane / 4) holds element d = (HD/8) g + 2 i + h, a thread's HD/8 contiguous elements of a
position's row (8 bytes at fp8 and head_dim 64); O^T is relabelled back once a split. P converts from S^T's
accumulator to the B operand within each warp (shuffles).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..device import kv_stream, layouts
from ..device.ring import consumer_release
from ..state import EMPTY_M

EMPTY_M_D: gl.constexpr = gl.constexpr(EMPTY_M)

# the contraction relabellings (module doc), as a reshape of the physical head_dim index and a permutation of it
K_ORDER: gl.constexpr = gl.constexpr((0, 1, 3, 4, 2, 5))  # [NW, PW, c, s, h, e] -> [NW, PW, s, h, c, e]
V_ORDER: gl.constexpr = gl.constexpr((0, 3, 4, 2, 1))  # [NW, PW, g, i, h] -> [NW, i, h, g, PW]
O_ORDER: gl.constexpr = gl.constexpr((0, 4, 3, 1, 2))  # O^T [NW, i, h, g, N] -> [NW, N, g, i, h]: the rows' order


@constexpr_function
def k_split(hd):
    """K's head_dim index as [c, s, h, e]: d = ((c S + s) 2 + h) 2 + e, S = hd / 16 k-steps."""
    return [4, hd // 16, 2, 2]


@constexpr_function
def v_split(hd):
    """V's head_dim index as [g, i, h]: d = (g I + i) 2 + h, I = hd / 16 row tiles of O^T."""
    return [8, hd // 16, 2]


def applies(kvs: int, num_warps: int) -> bool:
    """Whether a one-token step's ring slots of ``kvs`` positions (plan.kv_ring: a power of two) run here: every
    warp's rows of a slot whole m16 tiles, 16 positions a warp or more."""
    return kvs > 0 and kvs % (16 * num_warps) == 0


@constexpr_function
def heads(C):
    """N: the group's heads padded to mma's n8 (columns past GP are padding: q = 0, never stored)."""
    return max(8, C.GP)


@constexpr_function
def mma_layout(C):
    """[NW, rows, N] accumulators: one batch a warp (its positions, or its O^T), m16n8 tiles."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[C.NW, 1, 1], instr_shape=[1, 16, 8])


@constexpr_function
def operand_type(C):
    """The products' element type: f16 over an fp8 slot (e4m3 widens to it exactly), else bf16."""
    return gl.float16 if C.FP8 else gl.bfloat16


@gluon.jit
def _k_view(rows, C: gl.constexpr):
    """A slot's K rows (flat) as the A operand's [NW, PW, HD] in the relabelled head_dim order."""
    PW: gl.constexpr = C.KVS // C.NW
    return rows.reshape([C.NW, PW] + k_split(C.HD)).permute(K_ORDER.value).reshape([C.NW, PW, C.HD])


@gluon.jit
def _v_view(rows, C: gl.constexpr):
    """A slot's V rows (flat) as V^T, the A operand's [NW, HD, PW] in the relabelled head_dim order."""
    PW: gl.constexpr = C.KVS // C.NW
    return rows.reshape([C.NW, PW] + v_split(C.HD)).permute(V_ORDER.value).reshape([C.NW, C.HD, PW])


@gluon.jit
def _q_operand(q_ptr, kvh, qscale, C: gl.constexpr):
    """q^T [NW, HD, N] as the B operand of every warp, pre-scaled (head_dim^-0.5 log2 e) and rounded to the
    operand type, head_dim relabelled as K's; padding heads 0. Once a split."""
    N: gl.constexpr = heads(C)
    HD: gl.constexpr = C.HD
    QL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32 // min(32, HD // 4), min(32, HD // 4)], [C.NW, 1, 1],
                                        [2, 1, 0])
    n = gl.expand_dims(gl.expand_dims(gl.arange(0, N, gl.SliceLayout(0, gl.SliceLayout(2, QL))), 0), 2)
    d = gl.expand_dims(gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, QL))), 0), 1)
    w = gl.expand_dims(gl.expand_dims(gl.arange(0, C.NW, gl.SliceLayout(1, gl.SliceLayout(2, QL))), 1), 2)
    q = gl.load(q_ptr + (kvh * C.G + n) * HD + d + w * 0, mask=(n < C.G) & (d >= 0) & (w >= 0), other=0.0,
                cache_modifier=".cg") * qscale  # [NW, N, HD]
    q = q.reshape([C.NW, N] + k_split(HD)).permute(K_ORDER.value).reshape([C.NW, N, HD]).permute((0, 2, 1))
    return gl.convert_layout(q.to(operand_type(C)), gl.DotOperandLayout(operand_index=1, parent=mma_layout(C),
                                                                        k_width=2))


@gluon.jit
def _slot(qt, kk, vt, ks, vs, ok_r, ok_a, m, l, o, cs, MASKED: gl.constexpr, C: gl.constexpr):
    """One slot's products and online-softmax update, every warp over its PW rows: kk [NW, PW, HD] and vt [NW, HD,
    PW] as loaded (the cache's element type), (C.FP8) the rows' scales ks, vs [NW, PW]; state m [NW, N], l [NW, PW,
    N] (a row's running sum; summed over rows once a split), o = O^T [NW, HD, N] over cs [NW, 1] (fp8: the divisor
    of V's scales it carries, else 1). ``MASKED``: rows outside ``ok_r`` [NW, PW] (``ok_a`` [NW, 1, PW], V^T's
    columns) get no weight, and their V rows are zeroed (stale bytes may be NaN, and 0 * NaN is NaN)."""
    MMA: gl.constexpr = mma_layout(C)
    MT: gl.constexpr = operand_type(C)
    s = mma_v2(kk.to(MT), qt, gl.zeros(l.shape, gl.float32, MMA))  # [NW, PW, N]
    if C.FP8:
        s = s * gl.expand_dims(ks.to(gl.float32), 2)
    if MASKED:
        s = gl.where(gl.expand_dims(ok_r, 2), s, EMPTY_M_D)
    m_new = gl.maximum(m, gl.max(s, axis=1))  # a warp's rows: within the thread, then shuffles
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    if MASKED:
        p = gl.where(gl.expand_dims(ok_r, 2), p, 0.0)
    l = l * gl.expand_dims(alpha, 1) + p
    f = alpha
    if C.FP8:  # p weights V by its row's scale over the warp's largest in the slot: f16 probabilities in [0, 1]
        v3 = gl.expand_dims(vs.to(gl.float32), 2)  # [NW, PW, 1]
        if MASKED:
            v3 = gl.where(gl.expand_dims(ok_r, 2), v3, 0.0)
        c = gl.max(v3, axis=1)  # [NW, 1]
        c = gl.where(c > 0.0, c, cs)  # no live row in the slot: keep the divisor
        rc = 1.0 / c  # one division a slot
        p = p * (v3 * gl.expand_dims(rc, 1))
        f = alpha * (cs * rc)
        cs = c
    v = vt.to(MT)
    if MASKED:
        v = gl.where(ok_a, v, 0.0)
    pb = gl.convert_layout(p.to(MT), gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
    o = mma_v2(v, pb, o * gl.expand_dims(f, 1))
    return m_new, l, o, cs


@gluon.jit
def _real_heads(x, C: gl.constexpr):
    """x [NW, N, R] with its padding columns (N past GP; column = pad GP + head) dropped: [NW, GP, R]. Once a
    split: the columns go into each thread's registers first, where a split can take the pad index apart."""
    N: gl.constexpr = heads(C)
    GP: gl.constexpr = C.GP
    R: gl.constexpr = x.shape[2]
    NP: gl.constexpr = N // GP
    x = gl.convert_layout(x, gl.BlockedLayout([1, N, 1], [1, 1, 32], [C.NW, 1, 1], [1, 2, 0]))
    x = x.reshape([C.NW, NP, GP * R]).permute((0, 2, 1))  # [NW, GP R, NP]
    if NP >= 8:
        x, _ = gl.split(x.reshape([C.NW, GP * R, NP // 2, 2]))
    if NP >= 4:
        x, _ = gl.split(x.reshape([C.NW, GP * R, 2, 2]))
    if NP >= 2:
        x, _ = gl.split(x)
    else:
        x = gl.sum(x, axis=2)
    return x.reshape([C.NW, GP, R])


@gluon.jit
def walk(q_ptr, kvh, lo, hp, a0, n, qscale, sm, it, C: gl.constexpr):
    """A one-token split's past positions [lo, hp) from its n ring slots (from position a0, tile ``it`` on): each
    slot's rows read into the operands' registers and the slot handed back to the loader before its math; positions
    outside [lo, hp) masked in the split's first and last slots. Returns (the running tile counter past the slots,
    and every warp's state in ``layouts.attention``'s slices: m, l [NW, GP] (base 2), o [NW, GP, HD])."""
    NW: gl.constexpr = C.NW
    HD: gl.constexpr = C.HD
    KVS: gl.constexpr = C.KVS
    PW: gl.constexpr = KVS // NW
    N: gl.constexpr = heads(C)
    gl.static_assert(PW % 16 == 0, "a slot must hold 16 positions a warp (plan.py: ATTN_MMA where ``applies``)")
    MMA: gl.constexpr = mma_layout(C)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(2, MMA)  # [NW, PW]
    ST: gl.constexpr = gl.SliceLayout(1, MMA)  # [NW, N]
    EL: gl.constexpr = kv_stream.element(C)
    qt = _q_operand(q_ptr, kvh, qscale, C)
    rw = gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, ROW)), 1) * PW + gl.expand_dims(
        gl.arange(0, PW, gl.SliceLayout(0, ROW)), 0)  # [NW, PW] a row's position in the slot
    AK: gl.constexpr = gl.SliceLayout(1, A)
    ra = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, AK)), 1) * PW + gl.expand_dims(
        gl.arange(0, PW, gl.SliceLayout(0, AK)), 0), 1)  # [NW, 1, PW] V^T's columns' positions
    m = gl.full([NW, N], EMPTY_M_D, gl.float32, ST)
    l = gl.zeros([NW, PW, N], gl.float32, MMA)
    o = gl.zeros([NW, HD, N], gl.float32, MMA)
    cs = gl.full([NW, 1], 1.0, gl.float32, ST)
    for j in range(n):
        idx = it % C.NB
        mbarrier.wait(sm.ready.index(idx), (it // C.NB) & 1)
        rows = sm.bufs.index(idx)._reinterpret(EL, [2, NW * PW * HD], kv_stream.flat(1))  # K's, then V's
        kk = _k_view(rows.index(0), C).load(A)
        vt = _v_view(rows.index(1), C).load(A)
        ks = rw
        vs = rw
        if C.FP8:
            scl = sm.sbuf.index(idx)._reinterpret(gl.bfloat16, [2 * NW, PW], kv_stream.flat(2))
            ks = scl.slice(0, NW).load(ROW)
            vs = scl.slice(NW, NW).load(ROW)
        consumer_release(sm.empty, idx)  # every warp has read the slot (the barrier Gluon places before the arrive)
        t0 = a0 + j * KVS
        if (t0 >= lo) & (t0 + KVS <= hp):  # a whole slot of the split's past: no masks
            m, l, o, cs = _slot(qt, kk, vt, ks, vs, rw, ra, m, l, o, cs, False, C)
        else:
            m, l, o, cs = _slot(qt, kk, vt, ks, vs, (t0 + rw >= lo) & (t0 + rw < hp),
                                (t0 + ra >= lo) & (t0 + ra < hp), m, l, o, cs, True, C)
        it += 1
    if C.FP8:
        o = o * gl.expand_dims(cs, 1)
    L4: gl.constexpr = layouts.attention(C)
    S3: gl.constexpr = gl.SliceLayout(3, L4)
    m_w = gl.sum(_real_heads(gl.expand_dims(m, 1).permute((0, 2, 1)), C), axis=2)  # [NW, GP]
    l_w = gl.sum(_real_heads(gl.expand_dims(gl.sum(l, axis=1), 1).permute((0, 2, 1)), C), axis=2)
    o_w = _real_heads(o.reshape([NW, HD // 16, 2, 8, N]).permute(O_ORDER.value).reshape([NW, N, HD]), C)  # [NW, GP, HD]
    m_w = gl.convert_layout(m_w, gl.SliceLayout(2, S3))
    l_w = gl.convert_layout(l_w, gl.SliceLayout(2, S3))
    return it, m_w, l_w, gl.convert_layout(o_w, gl.SliceLayout(2, L4))


# --- PyTorch emulation of the tiling (CPU tests) -----------------------------------------------------------------

def k_relabel(hd: int) -> torch.Tensor:
    """[hd]: the element d of a K row (and of q) that the A (B) operand's column k holds."""
    return torch.arange(hd).reshape(k_split(hd)).permute([o - 2 for o in K_ORDER.value[2:]]).reshape(hd)


def v_relabel(hd: int) -> torch.Tensor:
    """[hd]: the element d of a V row that V^T's (and O^T's) row holds."""
    return torch.arange(hd).reshape(v_split(hd)).permute(1, 2, 0).reshape(hd)


def emulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor | None, vs: torch.Tensor | None,
            valid: torch.Tensor, nw: int, kvs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``walk``'s tiling over slots of ``kvs`` positions: q [G, HD] pre-scaled (base 2), k and v [n kvs, HD] the
    slots' rows (fp8: e4m3 values, ks and vs [n kvs] their scales; else bf16), ``valid`` [n kvs] the split's
    positions. Every warp's state: (m, l [nw, G] base 2, o [nw, G, HD]). Products on the operand type (f16 over fp8,
    bf16) with fp32 sums, the relabelled operands, the per-warp online softmax and the V-scale divisor as the
    device computes them."""
    g, hd = q.shape
    n_ = max(8, 1 << (g - 1).bit_length())
    pw = kvs // nw
    fp8 = ks is not None
    mt = torch.float16 if fp8 else torch.bfloat16
    kr, vr = k_relabel(hd), v_relabel(hd)
    qt = torch.zeros(hd, n_)
    qt[:, :g] = q[:, kr].t().to(mt).float()  # [HD, N] relabelled rows
    m = torch.full((nw, n_), EMPTY_M)
    l = torch.zeros(nw, pw, n_)
    o = torch.zeros(nw, hd, n_)
    cs = torch.ones(nw, 1)
    for j in range(k.shape[0] // kvs):
        sl = slice(j * kvs, (j + 1) * kvs)
        kk = k[sl][:, kr].to(mt).float().reshape(nw, pw, hd)
        vt = v[sl][:, vr].to(mt).float().reshape(nw, pw, hd).transpose(1, 2)  # [nw, HD, pw]
        ok = valid[sl].reshape(nw, pw)
        s = kk @ qt  # [nw, pw, N]
        if fp8:
            s = s * ks[sl].float().reshape(nw, pw, 1)
        s = torch.where(ok[..., None], s, torch.tensor(EMPTY_M))
        m_new = torch.maximum(m, s.amax(1))
        alpha = torch.exp2(m - m_new)
        p = torch.where(ok[..., None], torch.exp2(s - m_new[:, None]), torch.tensor(0.0))
        l = l * alpha[:, None] + p
        f = alpha
        if fp8:
            v3 = torch.where(ok, vs[sl].float().reshape(nw, pw), torch.tensor(0.0))[..., None]
            c = v3.amax(1)
            c = torch.where(c > 0, c, cs)
            rc = 1.0 / c
            p = p * (v3 * rc[:, None])
            f = alpha * (cs * rc)
            cs = c
        vt = torch.where(ok[:, None, :], vt, torch.tensor(0.0))
        o = o * f[:, None] + vt @ p.to(mt).float()
        m = m_new
    o = o * cs[:, None]
    o_rows = torch.empty(nw, n_, hd)
    o_rows[:, :, vr] = o.transpose(1, 2)  # back to the rows' head_dim order
    return m[:, :g], l.sum(1)[:, :g], o_rows[:, :g]
