"""Device code of the matvec instructions (ATTN_IN, O_PROJ, MLP_IN, DOWN_PROJ, LM_HEAD): the compute side.

Every matvec instruction streams whole weight tiles [TR, TK] (bf16) through the ring; the loader issues them in
exactly the order these functions consume them (row tile by row tile, TK-wide column tiles within a row tile).
The input vector of the instruction (RMSNorm(x), the attention output or the MLP activation) is staged once per
instruction into shared memory ``hbuf`` [KT_PAD, TK] bf16 — bf16, like the reference decoder's activations, so the
largest input (the 8B MLP's 14336) fits beside the ring — and is re-read from shared memory for every row tile.
Columns past K are staged as zeros, matching the TMA engine's zero fill of out-of-bounds weight columns.
Tiles are reduced on the tensor cores (``dot_tile_mma``, the default) or on the CUDA cores, chosen by the ring's
slot shape (``KernelConfig.mma``).
PyTorch references of each instruction: ``mimw.megakernel.ops`` (the VM's solvers).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from . import cluster, versioned
from .orchestration import consumer_acquire, consumer_release, warp_release

MAX_PARTS: gl.constexpr = gl.constexpr(8)  # ATTN_IN column parts a head may have (KernelConfig.check)


@gluon.jit
def dot_tile(bufs, empty, ready, hbuf, it, k0, k1, LAY: gl.constexpr, stamps=None, SHFL: gl.constexpr = False,
             WOFF: gl.constexpr = 0, REBASE: gl.constexpr = False):
    """One row tile: sum over column tiles [k0, k1) of W_tile . h_chunk -> ([TR] fp32 in SliceLayout(1, LAY), it').
    Column tile k's chunk is staged row k of ``hbuf``, or with ``REBASE`` row k - k0 (``stage_span``,
    KernelConfig.half_hbuf).
    The ring's slot shape selects the consumer: [TR, TK] slots are reduced on the CUDA cores (bf16 -> fp32 converts
    and FMAs), folded [TR * TK / FK, FK] slots on the tensor cores (``dot_tile_mma``; ``SHFL``: its folds summed by
    warp shuffles, KernelConfig.fold_shuffle; ``WOFF`` > 0: its slots released warp by warp, KernelConfig.
    warp_release, orchestration.warp_release)."""
    if bufs.type.shape[2] == hbuf.type.shape[1]:
        gl.static_assert(WOFF == 0, "per-warp releases: the tensor-core consumer only")
        out, it = _dot_tile_fma(bufs, empty, ready, hbuf, it, k0, k1, LAY, stamps, REBASE)
    else:
        out, it = dot_tile_mma(bufs, empty, ready, hbuf, it, k0, k1, LAY, stamps, SHFL, WOFF, REBASE)
    return out, it


@gluon.jit
def _dot_tile_fma(bufs, empty, ready, hbuf, it, k0, k1, LAY: gl.constexpr, stamps=None,
                  REBASE: gl.constexpr = False):
    TR: gl.constexpr = bufs.type.shape[1]
    TK: gl.constexpr = bufs.type.shape[2]
    acc = gl.zeros([TR, TK], gl.float32, LAY)
    for k in range(k0, k1):
        if REBASE:
            xk = hbuf.index(k - k0).load(gl.SliceLayout(0, LAY)).to(gl.float32)
        else:
            xk = hbuf.index(k).load(gl.SliceLayout(0, LAY)).to(gl.float32)
        w, idx = consumer_acquire(bufs, ready, it, LAY, stamps)
        consumer_release(empty, idx)
        acc += w.to(gl.float32) * gl.expand_dims(xk, 0)
        it += 1
    return gl.sum(acc, axis=1), it


@gluon.jit
def dot_tile_mma(bufs, empty, ready, hbuf, it, k0, k1, LAY: gl.constexpr, stamps=None, SHFL: gl.constexpr = False,
                 WOFF: gl.constexpr = 0, REBASE: gl.constexpr = False):
    """``dot_tile`` on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate). A tile-major [TR, TK] block
    read as a row-major [FR, FK] matrix (FK = 32, FR = TR * NF, NF = TK / FK folds) has row NF r + j = W[r, FK j ..
    FK j + FK): the TMA descriptor describes the same bytes that way (``KernelConfig.tile_box``). Against the
    staged chunk read as B = [FK, NF] (column j = h[FK j .. FK j + FK)), D = A B holds in D[NF r + j, j] row r's
    partial dot over fold j, so row r = sum_j D[NF r + j, j]. Per tile each warp issues FR / 16 / num_warps * 2
    ldmatrix.x4 and as many mma.sync, instead of TR * TK / 32 / num_warps converts and FMAs per thread. Releasing slots
    in pairs was measured slower (triton 3.6 places a barrier before every arrive anyway; bench/NOTES.md, session
    11). The epilogue sums each row's NF folds: by default through two layout conversions (three barriers and
    shared-memory round trips a row tile); with ``SHFL`` the diagonal [FR] is reshaped in place to [TR, NF] — row
    NF r + j sits in lane group j of one warp in the mma layout, so the fold sum is a warp shuffle reduction —
    and one conversion remains, to the caller's layout."""
    FR: gl.constexpr = bufs.type.shape[1]
    FK: gl.constexpr = bufs.type.shape[2]
    TK: gl.constexpr = hbuf.type.shape[1]
    NF: gl.constexpr = TK // FK
    TR: gl.constexpr = FR // NF
    NW: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # the staged vector as [column tile, fold, FK]: one column tile's chunk is the [NF, FK] matrix B^T
    h3 = hbuf._reinterpret(gl.bfloat16, [hbuf.type.shape[0], NF, FK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    acc = gl.zeros([FR, NF], gl.float32, MMA)
    for k in range(k0, k1):
        a, idx = consumer_acquire(bufs, ready, it, AL, stamps)
        if REBASE:  # KernelConfig.half_hbuf: the span [k0, k1) staged from row 0 (stage_span)
            b = h3.index(k - k0).permute((1, 0)).load(BL)
        else:
            b = h3.index(k).permute((1, 0)).load(BL)
        if WOFF > 0:  # KernelConfig.warp_release: each warp hands the slot back once its own reads are done
            warp_release(idx, WOFF, NW)
        else:
            consumer_release(empty, idx)
        acc = mma_v2(a, b, acc)
        it += 1
    r = gl.arange(0, FR, gl.SliceLayout(1, MMA))
    j = gl.arange(0, NF, gl.SliceLayout(0, MMA))
    diag = gl.sum(gl.where(gl.expand_dims(r % NF, 1) == gl.expand_dims(j, 0), acc, 0.0), axis=1)  # [FR]
    if SHFL:
        folds = gl.reshape(diag, [TR, NF])  # the layout follows (a linear layout): no data moves
    else:
        folds = gl.reshape(gl.convert_layout(diag, gl.BlockedLayout([NF], [32], [NW], [0])), [TR, NF])
    return gl.convert_layout(gl.sum(folds, axis=1), gl.SliceLayout(1, LAY)), it


@gluon.jit
def _group(hbuf, g0, SG: gl.constexpr):
    """Rows g0 .. g0+SG-1 of hbuf as a rank-2 row-major view for one whole-group store (hbuf itself has a rank-1
    layout so that ``hbuf.index(k)`` yields a [TK] row; without swizzling both describe the same bytes; the row
    count is a power of two, as a rank-2 layout needs)."""
    rows2 = hbuf._reinterpret(hbuf.dtype, hbuf.type.shape, gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    return rows2.slice(g0, SG)


@gluon.jit
def _group_offsets(g0, SG: gl.constexpr, TK: gl.constexpr, S2: gl.constexpr):
    """Element offsets [SG, TK] of column tiles g0 .. g0+SG-1 of a vector."""
    r = gl.arange(0, SG, gl.SliceLayout(1, S2))
    c = gl.arange(0, TK, gl.SliceLayout(0, S2))
    return gl.expand_dims(g0 + r, 1) * TK + gl.expand_dims(c, 0)


@gluon.jit
def _sum_parts(xp_ptr, o, m, K, XP: gl.constexpr):
    """x after an O_PROJ in column parts (KernelConfig.o_parts): the XP parts' vectors at offsets ``o`` (mask ``m``;
    part p at ``xp_ptr + p * K``) summed in part order, fp32; every part's load is issued before the sum.
    Reference: ops/common.x_after_attention."""
    v = gl.load(xp_ptr + o, mask=m, other=0.0, cache_modifier=".cg")
    for p in gl.static_range(1, XP):
        v += gl.load(xp_ptr + p * K + o, mask=m, other=0.0, cache_modifier=".cg")
    return v


@gluon.jit
def _residual_group(x_ptr, emb_ptr, from_embed, o, lo, K, ver=0, VX: gl.constexpr = 0, xp_ptr=None,
                    XP: gl.constexpr = 0):
    """The residual row at offsets ``o`` (the group from element ``lo``; masked past K) as fp32: x (written by other
    CTAs this step: through L2; ``VX``: versioned words, waited for at version ``ver``, VX > 1 the probe stride;
    ``XP``: the sum of the XP O_PROJ parts at ``xp_ptr``), or for layer 0 the bf16 embedding row."""
    if from_embed:
        v = gl.load(emb_ptr + o, mask=o < K, other=0.0).to(gl.float32)
    else:
        if VX:  # VX > 1: the probe stride (KernelConfig.vprobe)
            v = versioned.wait_vector(x_ptr, o, lo, K, ver, VX)
        elif XP > 0:
            v = _sum_parts(xp_ptr, o, o < K, K, XP)
        else:
            v = gl.load(x_ptr + o, mask=o < K, other=0.0, cache_modifier=".cg")
    return v


@gluon.jit
def stage_normed(hbuf, x_ptr, emb_ptr, from_embed, norm_ptr, K, eps, KT: gl.constexpr, SG: gl.constexpr,
                 S2: gl.constexpr, ver=0, VX: gl.constexpr = 0, xp_ptr=None, XP: gl.constexpr = 0):
    """hbuf <- (x * rsqrt(mean(x^2) + eps)).to(bf16) * norm_w, x = the fp32 residual row, or (layer 0) the bf16
    embedding row at ``emb_ptr``. When the row fits one staging group (KT <= SG: every model up to 4096 wide at
    TK = 256) x and the norm weights are loaded once, together: one L2 round trip. Wider rows take two passes
    over x (sum of squares, then scale and store), each in groups of SG column tiles whose loads are all in
    flight together. ``VX``: x is versioned words, waited for at version ``ver`` (isa.READS_X); VX > 1: probed
    one word in VX (versioned.wait). ``XP``: x is the sum of the XP O_PROJ parts at ``xp_ptr`` (o_parts)."""
    TK: gl.constexpr = hbuf.type.shape[1]
    if KT <= SG:
        o = _group_offsets(0, SG, TK, S2)
        v = _residual_group(x_ptr, emb_ptr, from_embed, o, 0, K, ver, VX, xp_ptr, XP)
        w = gl.load(norm_ptr + o, mask=o < K, other=0.0)
        rs = gl.rsqrt(gl.sum(gl.sum(v * v, axis=1), axis=0) / K + eps)
        _group(hbuf, 0, SG).store((v * rs).to(gl.bfloat16) * w)
    else:
        ss = gl.zeros([SG, TK], gl.float32, S2)
        for g0 in gl.static_range(0, KT, SG):
            o = _group_offsets(g0, SG, TK, S2)
            v = _residual_group(x_ptr, emb_ptr, from_embed, o, g0 * TK, K, ver, VX, xp_ptr, XP)
            ss += v * v
        rs = gl.rsqrt(gl.sum(gl.sum(ss, axis=1), axis=0) / K + eps)
        for g0 in gl.static_range(0, KT, SG):
            o = _group_offsets(g0, SG, TK, S2)
            v = _residual_group(x_ptr, emb_ptr, from_embed, o, g0 * TK, K, ver, VX, xp_ptr, XP)
            w = gl.load(norm_ptr + o, mask=o < K, other=0.0)
            _group(hbuf, g0, SG).store((v * rs).to(gl.bfloat16) * w)
    gl.thread_barrier()  # staged vector visible to every compute warp before the first row tile reads it


@gluon.jit
def stage_plain(hbuf, src_ptr, K, KT: gl.constexpr, SG: gl.constexpr, S2: gl.constexpr, k0=0, k1=0,
                PART: gl.constexpr = False):
    """hbuf <- src (fp32 activations written by other CTAs this step) rounded to bf16; zeros past K. Loads go in
    groups of SG column tiles, all in flight together. ``PART`` (KernelConfig.down_half_stage): only the groups
    that hold a column tile of [k0, k1) are loaded (a DOWN_PROJ half reads no other); the others' loads are masked,
    no request and no round trip, and stage zeros."""
    TK: gl.constexpr = hbuf.type.shape[1]
    for g0 in gl.static_range(0, KT, SG):
        o = _group_offsets(g0, SG, TK, S2)
        m = o < K
        if PART:
            m = m & (g0 + SG > k0) & (g0 < k1)
        v = gl.load(src_ptr + o, mask=m, other=0.0, cache_modifier=".cg")
        _group(hbuf, g0, SG).store(v.to(gl.bfloat16))
    gl.thread_barrier()


@gluon.jit
def stage_span(hbuf, src_ptr, K, k0, k1, NT: gl.constexpr, SG: gl.constexpr, S2: gl.constexpr):
    """KernelConfig.half_hbuf: hbuf rows 0 .. k1 - k0 <- column tiles [k0, k1) of src (fp32, written by other CTAs
    this step) rounded to bf16, as ``stage_plain`` rounds them; zeros past K and past k1 (NT >= k1 - k0 rows
    staged, in groups of SG column tiles whose loads are all in flight together). A DOWN_PROJ half's act columns:
    the staging buffer then needs only the widest half's rows (``dot_tile`` reads row k - k0)."""
    TK: gl.constexpr = hbuf.type.shape[1]
    for g0 in gl.static_range(0, NT, SG):
        o = k0 * TK + _group_offsets(g0, SG, TK, S2)
        v = gl.load(src_ptr + o, mask=(o < K) & (o < k1 * TK), other=0.0, cache_modifier=".cg")
        _group(hbuf, g0, SG).store(v.to(gl.bfloat16))
    gl.thread_barrier()


@gluon.jit
def stage_versioned(hbuf, src_ptr, K, ver, KT: gl.constexpr, SG: gl.constexpr, S2: gl.constexpr,
                    PROBE: gl.constexpr = 1):
    """``stage_plain`` of a vector of versioned words (isa.READS_ACT): the load is the wait, group by group of SG
    column tiles; the payloads (fp32) are rounded to bf16 as ``stage_plain`` rounds them. PROBE > 1: a group found
    incomplete is probed one word in PROBE (versioned.wait)."""
    TK: gl.constexpr = hbuf.type.shape[1]
    for g0 in gl.static_range(0, KT, SG):
        o = _group_offsets(g0, SG, TK, S2)
        v = versioned.wait_vector(src_ptr, o, g0 * TK, K, ver, PROBE)
        _group(hbuf, g0, SG).store(v.to(gl.bfloat16))
    gl.thread_barrier()


@gluon.jit
def residual_rows(bufs, empty, ready, hbuf, it, KT, row0, n_tiles, x_ptr, res_ptr, res_from_embed,
                  LAY: gl.constexpr, stamps=None, ver_in=0, ver_out=0, VX: gl.constexpr = False, k0=0, out_ptr=None,
                  add_res=True, xp_ptr=None, XP: gl.constexpr = 0, XS=0, SHFL: gl.constexpr = False,
                  WOFF: gl.constexpr = 0):
    """O_PROJ / DOWN_PROJ: x[rows] = residual[rows] + W[rows] . h over column tiles [k0, KT), tile by tile (the
    residual is x itself, or for layer 0's O_PROJ the bf16 embedding row). Each row tile's residual is requested
    before its dot product, so its round trip overlaps the tile loop. ``VX``: x is versioned words: the residual
    rows are waited for at ``ver_in``, the new rows stored at ``ver_out`` (isa.READS_X, isa.WRITES_VERSIONED).
    O_PROJ in column parts (KernelConfig.o_parts): ``out_ptr`` (its x part) instead of x, and the residual only
    where ``add_res`` (part 0); DOWN_PROJ after them: ``XP`` > 0, the residual is the sum of the XP parts at
    ``xp_ptr``, ``XS`` apart."""
    TR: gl.constexpr = bufs.type.shape[1] * bufs.type.shape[2] // hbuf.type.shape[1]  # TR x TK per slot
    offs_r = gl.arange(0, TR, gl.SliceLayout(1, LAY))
    if out_ptr is None:
        out = x_ptr
    else:
        out = out_ptr
    for r in range(n_tiles):
        rows = row0 + r * TR + offs_r
        if add_res:
            if res_from_embed:
                res = gl.load(res_ptr + rows).to(gl.float32)
            else:
                if VX:
                    res = versioned.wait(x_ptr + rows, rows >= 0, ver_in)  # TR words: no probe
                elif XP > 0:
                    res = _sum_parts(xp_ptr, rows, rows >= 0, XS, XP)
                else:
                    res = gl.load(x_ptr + rows, cache_modifier=".cg")
        else:
            res = gl.zeros([TR], gl.float32, gl.SliceLayout(1, LAY))
        acc, it = dot_tile(bufs, empty, ready, hbuf, it, k0, KT, LAY, stamps, SHFL, WOFF)
        if VX:
            versioned.store(out + rows, res + acc, ver_out)
        else:
            gl.store(out + rows, res + acc)
    return it


@gluon.jit
def residual_rows_pair(bufs, empty, ready, hbuf, it, k0, k1, row0, n_tiles, x_ptr, part, xn, tid,
                       LAY: gl.constexpr, XB: gl.constexpr, HD: gl.constexpr, stamps=None, SHFL: gl.constexpr = False,
                       WOFF: gl.constexpr = 0, REBASE: gl.constexpr = False):
    """DOWN_PROJ as a cluster pair (ProgramConfig.cluster_down, isa.CLUSTER_PAIR): each row tile's sums over this
    part's column tiles [k0, k1) go to both CTAs' exchange slots (cluster.pair_store_async; one exchange a row
    tile, ``xn`` onwards); after the meet, part 0 stores x[rows] = x[rows] + (half 0 + half 1), both halves read
    from its slot in part order (ops/down_proj.finish); part 1 stores nothing. ``REBASE`` (KernelConfig.half_hbuf):
    the part's columns are staged from hbuf's first row (``stage_span``). Returns (it, xn)."""
    TR: gl.constexpr = bufs.type.shape[1] * bufs.type.shape[2] // hbuf.type.shape[1]  # TR x TK per slot
    NW: gl.constexpr = gl.num_warps()
    OWN: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # element e: lane e % 32 of every warp
    offs_r = gl.arange(0, TR, gl.SliceLayout(1, LAY))
    first = part == 0
    for r in range(n_tiles):
        rows = row0 + r * TR + offs_r
        res = gl.load(x_ptr + rows, mask=(rows >= 0) & first, other=0.0, cache_modifier=".cg")  # in flight now
        acc, it = dot_tile(bufs, empty, ready, hbuf, it, k0, k1, LAY, stamps, SHFL, WOFF, REBASE)
        cluster.pair_store_async(gl.convert_layout(acc, OWN), gl.arange(0, TR, OWN), part, xn, XB, HD)
        cluster.pair_meet_async(tid, xn, XB, HD, TR * 4)
        lo = cluster.pair_load(offs_r, 0, xn, XB, HD)
        hi = cluster.pair_load(offs_r, 1, xn, XB, HD)
        gl.store(x_ptr + rows, res + (lo + hi), mask=(rows >= 0) & first)
        xn += 1
    return it, xn


@gluon.jit
def plain_rows(bufs, empty, ready, hbuf, it, KT, row0, n_tiles, out_ptr, LAY: gl.constexpr, stamps=None,
               SHFL: gl.constexpr = False, WOFF: gl.constexpr = 0):
    """LM_HEAD: out[rows] = W[rows] . h."""
    TR: gl.constexpr = bufs.type.shape[1] * bufs.type.shape[2] // hbuf.type.shape[1]  # TR x TK per slot
    offs_r = gl.arange(0, TR, gl.SliceLayout(1, LAY))
    for r in range(n_tiles):
        acc, it = dot_tile(bufs, empty, ready, hbuf, it, 0, KT, LAY, stamps, SHFL, WOFF)
        gl.store(out_ptr + row0 + r * TR + offs_r, acc)
    return it


@gluon.jit
def gated_rows(bufs, empty, ready, hbuf, it, KT, row0, n_tiles, act_ptr, LAY: gl.constexpr, stamps=None, ver=0,
               VERSIONED: gl.constexpr = False, SHFL: gl.constexpr = False, WOFF: gl.constexpr = 0):
    """MLP_IN: every row tile holds TR/2 gate rows then the TR/2 up rows of the same outputs (pack.py), so one tile
    yields TR/2 outputs act[rows] = silu(gate . h) * (up . h) and MLP_IN blocks come in TR/2-row steps.
    ``VERSIONED``: act is a vector of versioned words, stored with version ``ver``."""
    TR: gl.constexpr = bufs.type.shape[1] * bufs.type.shape[2] // hbuf.type.shape[1]  # TR x TK per slot
    for t in range(n_tiles):
        acc, it = dot_tile(bufs, empty, ready, hbuf, it, 0, KT, LAY, stamps, SHFL, WOFF)
        a2 = gl.reshape(acc, [2, TR // 2])  # row h * TR/2 + j -> [h, j]: h = 0 gate, 1 up
        h = gl.expand_dims(gl.arange(0, 2, gl.SliceLayout(1, a2.type.layout)), 1)
        g = gl.sum(gl.where(h == 0, a2, 0.0), axis=0)
        u = gl.sum(gl.where(h == 1, a2, 0.0), axis=0)
        offs = gl.arange(0, TR // 2, g.type.layout)
        if VERSIONED:
            versioned.store(act_ptr + row0 + t * (TR // 2) + offs, g / (1.0 + gl.exp(-g)) * u, ver)
        else:
            gl.store(act_ptr + row0 + t * (TR // 2) + offs, g / (1.0 + gl.exp(-g)) * u)
    return it


@gluon.jit
def qkv_part(bufs, empty, ready, hbuf, it, k0, k1, head, part, qkvp_ptr, NQKV: gl.constexpr, HD: gl.constexpr,
             LAY: gl.constexpr, stamps=None, SHFL: gl.constexpr = False, xn=0, XB: gl.constexpr = 0,
             XA: gl.constexpr = False, WOFF: gl.constexpr = 0):
    """ATTN_IN, every part (M = 1): qkv_part[part, head] = W[head rows, column tiles k0..k1) . h, fp32 to global
    scratch (the head's finisher may run on another SM), or (``XB``: a cluster pair, isa.CLUSTER_PAIR) into
    exchange ``xn``'s slot of this CTA and of its mate (cluster.pair_store; ``XA``: pair_store_async)."""
    TR: gl.constexpr = bufs.type.shape[1] * bufs.type.shape[2] // hbuf.type.shape[1]  # TR x TK per slot
    NW: gl.constexpr = gl.num_warps()
    OWN: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # element e: lane e % 32 of every warp
    offs_r = gl.arange(0, TR, gl.SliceLayout(1, LAY))
    out = qkvp_ptr + (part * NQKV + head) * HD
    for r in gl.static_range(HD // TR):
        acc, it = dot_tile(bufs, empty, ready, hbuf, it, k0, k1, LAY, stamps, SHFL, WOFF)
        if XB > 0:
            if XA:
                cluster.pair_store_async(gl.convert_layout(acc, OWN), r * TR + gl.arange(0, TR, OWN), part, xn, XB,
                                         HD)
            else:
                cluster.pair_store(acc, r * TR + offs_r, part, xn, XB, HD)
        else:
            gl.store(out + r * TR + offs_r, acc)
    return it


@gluon.jit
def qkv_finish_inputs(layer, head, bias_ptr, qn_ptr, kn_ptr, invf_ptr, HQ: gl.constexpr, HKV: gl.constexpr,
                      HD: gl.constexpr, HAS_BIAS: gl.constexpr, QK_NORM: gl.constexpr, TR: gl.constexpr,
                      E2: gl.constexpr):
    """What ``qkv_finish`` reads that does not depend on this step, as [HD/2TR, TR] tiles of the two half heads:
    (inverse frequencies, q/k norm weights a and b, bias a and b; zeros where the model has none)."""
    NQKV: gl.constexpr = HQ + 2 * HKV
    HH: gl.constexpr = HD // (2 * TR)
    ti = gl.arange(0, HH, gl.SliceLayout(1, E2))
    ri = gl.arange(0, TR, gl.SliceLayout(0, E2))
    i = gl.expand_dims(ti, 1) * TR + gl.expand_dims(ri, 0)  # [HH, TR]: index within the half head
    inv_f = gl.load(invf_ptr + i)
    nw_a = inv_f * 0.0
    nw_b = inv_f * 0.0
    bias_a = inv_f * 0.0
    bias_b = inv_f * 0.0
    if head < HQ:
        nw = qn_ptr + layer * HD
    else:
        nw = kn_ptr + layer * HD
    if QK_NORM:
        nw_a = gl.load(nw + i).to(gl.float32)
        nw_b = gl.load(nw + HD // 2 + i).to(gl.float32)
    if HAS_BIAS:
        bb = bias_ptr + (layer * NQKV + head) * HD
        bias_a = gl.load(bb + i).to(gl.float32)
        bias_b = gl.load(bb + HD // 2 + i).to(gl.float32)
    return inv_f, nw_a, nw_b, bias_a, bias_b


@gluon.jit
def qkv_finish(layer, head, n_parts, pos, tok_page, qkvp_ptr, q_ptr, kc_ptr, vc_ptr, bias_ptr, qn_ptr, kn_ptr,
               invf_ptr, eps, NP, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr, PS: gl.constexpr,
               HAS_BIAS: gl.constexpr, QK_NORM: gl.constexpr, TR: gl.constexpr, E2: gl.constexpr, ver=0,
               VQ: gl.constexpr = False, xn=0, XB: gl.constexpr = 0, pre=None):
    """ATTN_IN, the head's last part: y = sum of the parts in part order (+bias) (+RMSNorm) (+RoPE), then store:
    q heads to q_ptr, k/v heads into the paged cache row of this token (page ``tok_page``). The halves a = y[:HD/2]
    and b = y[HD/2:] are held as [HD/2TR, TR] tiles (RoPE pairs element i with i + HD/2). ``VQ`` (isa.READS_Q):
    q_ptr holds versioned words for every head, [Hq + 2 Hkv, HD]: a q head is stored there at version ``ver``, and
    a k/v head's new row too (its bf16 values), besides the paged cache, which later steps read. ``XB`` (a cluster
    pair): the parts' sums come from the exchange slot of ``xn``, and ``pre`` holds ``qkv_finish_inputs``, loaded
    before the exchange's wait."""
    NQKV: gl.constexpr = HQ + 2 * HKV
    HH: gl.constexpr = HD // (2 * TR)
    ti = gl.arange(0, HH, gl.SliceLayout(1, E2))
    ri = gl.arange(0, TR, gl.SliceLayout(0, E2))
    i = gl.expand_dims(ti, 1) * TR + gl.expand_dims(ri, 0)  # [HH, TR]: index within the half head
    if XB > 0:  # a cluster pair (isa.CLUSTER_PAIR): both parts' sums are in this CTA's exchange slot, part order
        inv_f, nw_a, nw_b, bias_a, bias_b = pre
        a = cluster.pair_load(i, 0, xn, XB, HD) + cluster.pair_load(i, 1, xn, XB, HD)
        b = cluster.pair_load(HD // 2 + i, 0, xn, XB, HD) + cluster.pair_load(HD // 2 + i, 1, xn, XB, HD)
    else:
        # the loads that do not depend on this step first (inverse frequencies, q/k norm weights, bias): in flight
        # with the parts' loads, not a round trip after them (the parts' loop and the q/k norm's reduction, a
        # barrier, stand between them in program order)
        inv_f, nw_a, nw_b, bias_a, bias_b = qkv_finish_inputs(layer, head, bias_ptr, qn_ptr, kn_ptr, invf_ptr, HQ,
                                                              HKV, HD, HAS_BIAS, QK_NORM, TR, E2)
        src = qkvp_ptr + head * HD
        a = gl.load(src + i, cache_modifier=".cg")
        b = gl.load(src + HD // 2 + i, cache_modifier=".cg")
        # the parts unrolled and masked, so every part's loads are in flight together (a loop over n_parts would
        # wait for each part's round trip before issuing the next one's loads)
        for p in gl.static_range(1, MAX_PARTS):
            mp = i * 0 + p < n_parts
            a += gl.load(src + p * NQKV * HD + i, mask=mp, other=0.0, cache_modifier=".cg")
            b += gl.load(src + p * NQKV * HD + HD // 2 + i, mask=mp, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        a += bias_a
        b += bias_b
    if head < HQ + HKV:  # q and k heads: optional per-head RMSNorm, then RoPE
        if QK_NORM:
            rs = gl.rsqrt((gl.sum(gl.sum(a * a, axis=1), axis=0) + gl.sum(gl.sum(b * b, axis=1), axis=0)) / HD
                          + eps)
            a = (a * rs).to(gl.bfloat16).to(gl.float32) * nw_a
            b = (b * rs).to(gl.bfloat16).to(gl.float32) * nw_b
        ang = pos.to(gl.float32) * inv_f
        c = gl.cos(ang)
        s = gl.sin(ang)
        a2 = a * c - b * s
        b = b * c + a * s
        a = a2
    if head < HQ:
        qb = q_ptr + head * HD
        if VQ:
            versioned.store(qb + i, a, ver)
            versioned.store(qb + HD // 2 + i, b, ver)
        else:
            gl.store(qb + i, a)
            gl.store(qb + HD // 2 + i, b)
    else:
        kvh = (head - HQ) % HKV
        row = (((layer * NP + tok_page) * HKV + kvh) * PS + pos % PS) * HD
        if head < HQ + HKV:
            cache = kc_ptr + row
        else:
            cache = vc_ptr + row
        gl.store(cache + i, a.to(gl.bfloat16))
        gl.store(cache + HD // 2 + i, b.to(gl.bfloat16))
        if VQ:  # this step's readers take the row from here, not from the cache
            qb = q_ptr + head * HD
            versioned.store(qb + i, a.to(gl.bfloat16).to(gl.float32), ver)
            versioned.store(qb + HD // 2 + i, b.to(gl.bfloat16).to(gl.float32), ver)
