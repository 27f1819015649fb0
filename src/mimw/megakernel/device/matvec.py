"""The matvec building blocks of the compute role: staging an input vector, and reducing weight tiles against it.

Every matvec instruction streams whole weight tiles [TR, TK] (bf16) through the ring; the loader issues them in
exactly the order these functions consume them (row tile by row tile, TK-wide column tiles within a row tile). The
instruction's input vector (RMSNorm(x), the attention output or the MLP activation) is staged once per instruction
into shared memory ``hbuf`` [KT_ROWS, TK] bf16 (bf16, like the reference decoder's activations, so the largest input,
the 8B MLP's 14336, fits beside the ring) and re-read from shared memory for every row tile. Columns past K are
staged as zeros, matching the zero columns of the packed tiles.
Tiles are reduced on the tensor cores (``dot_tile``). PyTorch references of each instruction: its ``ops`` module.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from . import layouts
from .ring import consumer_acquire, consumer_release


@gluon.jit
def dot_tile(sm, it, k0, k1, C: gl.constexpr, REBASE: gl.constexpr = False):
    """One row tile: sum over column tiles [k0, k1) of W_tile . h_chunk -> ([TR] fp32 in SliceLayout(1, LAY), it'),
    on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate). Column tile k's chunk is row k of ``hbuf``,
    or with ``REBASE`` row k - k0 (``stage_span``). A slot holds the tile chunk-major, as a row-major [FR, FK]
    matrix (FK = 32, NF = TK / FK chunks, FR = NF * TR) whose row TR j + r = W[r, FK j .. FK j + FK) (launch/pack.py).
    Against the staged chunk read as B = [FK, NF] (column j = h[FK j .. FK j + FK)), D = A B holds in D[TR j + r, j]
    row r's partial dot over chunk j, so row r = sum_j D[TR j + r, j]. Per tile each warp issues
    FR / 16 / num_warps * 2 ldmatrix.x4 and as many mma.sync. The epilogue keeps each row's diagonal entry and sums
    the NF chunks of a row through one layout conversion. (A multi-token step reads the same slot as NF [TR, FK]
    K-major operands of wgmma.)"""
    bufs = sm.bufs
    hbuf = sm.hbuf
    FR: gl.constexpr = bufs.type.shape[1]
    FK: gl.constexpr = bufs.type.shape[2]
    TK: gl.constexpr = hbuf.type.shape[1]
    NF: gl.constexpr = TK // FK
    TR: gl.constexpr = FR // NF
    NW: gl.constexpr = C.NW
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # the staged vector as [column tile, fold, FK]: one column tile's chunk is the [NF, FK] matrix B^T
    h3 = hbuf._reinterpret(gl.bfloat16, [hbuf.type.shape[0], NF, FK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    acc = gl.zeros([FR, NF], gl.float32, MMA)
    for k in range(k0, k1):
        a, idx = consumer_acquire(bufs, sm.ready, it, AL)
        if REBASE:
            b = h3.index(k - k0).permute((1, 0)).load(BL)
        else:
            b = h3.index(k).permute((1, 0)).load(BL)
        consumer_release(sm.empty, idx)
        acc = mma_v2(a, b, acc)
        it += 1
    r = gl.arange(0, FR, gl.SliceLayout(1, MMA))
    j = gl.arange(0, NF, gl.SliceLayout(0, MMA))
    diag = gl.sum(gl.where(gl.expand_dims(r // TR, 1) == gl.expand_dims(j, 0), acc, 0.0), axis=1)  # [FR]
    CH: gl.constexpr = gl.BlockedLayout([NF, 1], [1, 32], [1, NW], [0, 1])  # a thread: one row's NF chunks
    chunks = gl.convert_layout(gl.reshape(diag, [NF, TR]), CH)
    return gl.convert_layout(gl.sum(chunks, axis=0), gl.SliceLayout(1, layouts.tile(C))), it


@gluon.jit
def _group(hbuf, g0, SG: gl.constexpr):
    """Rows g0 .. g0+SG-1 of hbuf as a rank-2 row-major view for one whole-group store (hbuf itself has a rank-1
    layout so that ``hbuf.index(k)`` yields a [TK] row; without swizzling both describe the same bytes; the row
    count is a power of two, as a rank-2 layout needs)."""
    rows2 = hbuf._reinterpret(hbuf.dtype, hbuf.type.shape, gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    return rows2.slice(g0, SG)


@gluon.jit
def _group_offsets(g0, C: gl.constexpr):
    """Element offsets [SG, TK] of column tiles g0 .. g0+SG-1 of a vector."""
    S2: gl.constexpr = layouts.staging(C)
    r = gl.arange(0, C.SG, gl.SliceLayout(1, S2))
    c = gl.arange(0, C.TK, gl.SliceLayout(0, S2))
    return gl.expand_dims(g0 + r, 1) * C.TK + gl.expand_dims(c, 0)


@gluon.jit
def _residual_group(x_ptr, emb_ptr, from_embed, o, K):
    """The residual row at offsets ``o`` (masked past K) as fp32: x (written by other CTAs this step: through L2),
    or for layer 0 the bf16 embedding row."""
    if from_embed:
        v = gl.load(emb_ptr + o, mask=o < K, other=0.0).to(gl.float32)
    else:
        v = gl.load(x_ptr + o, mask=o < K, other=0.0, cache_modifier=".cg")
    return v


@gluon.jit
def stage_normed(hbuf, x_ptr, emb_ptr, from_embed, norm_ptr, K, eps, KT: gl.constexpr, C: gl.constexpr):
    """hbuf <- (x * rsqrt(mean(x^2) + eps)).to(bf16) * norm_w, x = the fp32 residual row, or (layer 0) the bf16
    embedding row at ``emb_ptr``. When the row fits one staging group (KT <= SG: every model up to 4096 wide at
    TK = 256) x and the norm weights are loaded once, together: one L2 round trip. Wider rows take two passes
    over x (sum of squares, then scale and store), each in groups of SG column tiles whose loads are all in
    flight together."""
    SG: gl.constexpr = C.SG
    if KT <= SG:
        o = _group_offsets(0, C)
        v = _residual_group(x_ptr, emb_ptr, from_embed, o, K)
        w = gl.load(norm_ptr + o, mask=o < K, other=0.0)
        rs = gl.rsqrt(gl.sum(gl.sum(v * v, axis=1), axis=0) / K + eps)
        _group(hbuf, 0, SG).store((v * rs).to(gl.bfloat16) * w)
    else:
        TK: gl.constexpr = C.TK
        ss = gl.zeros([SG, TK], gl.float32, layouts.staging(C))
        for g0 in gl.static_range(0, KT, SG):
            o = _group_offsets(g0, C)
            v = _residual_group(x_ptr, emb_ptr, from_embed, o, K)
            ss += v * v
        rs = gl.rsqrt(gl.sum(gl.sum(ss, axis=1), axis=0) / K + eps)
        for g0 in gl.static_range(0, KT, SG):
            o = _group_offsets(g0, C)
            v = _residual_group(x_ptr, emb_ptr, from_embed, o, K)
            w = gl.load(norm_ptr + o, mask=o < K, other=0.0)
            _group(hbuf, g0, SG).store((v * rs).to(gl.bfloat16) * w)
    gl.thread_barrier()  # staged vector visible to every compute warp before the first row tile reads it


@gluon.jit
def stage_plain(hbuf, src_ptr, K, KT: gl.constexpr, C: gl.constexpr):
    """hbuf <- src (fp32 activations written by other CTAs this step) rounded to bf16; zeros past K. Loads go in
    groups of SG column tiles, all in flight together."""
    SG: gl.constexpr = C.SG
    for g0 in gl.static_range(0, KT, SG):
        o = _group_offsets(g0, C)
        v = gl.load(src_ptr + o, mask=o < K, other=0.0, cache_modifier=".cg")
        _group(hbuf, g0, SG).store(v.to(gl.bfloat16))
    gl.thread_barrier()


@gluon.jit
def stage_span(hbuf, src_ptr, K, k0, k1, NT: gl.constexpr, C: gl.constexpr):
    """hbuf rows 0 .. k1 - k0 <- column tiles [k0, k1) of src (fp32, written by other CTAs this step) rounded to
    bf16, as ``stage_plain`` rounds them; zeros past K and past k1 (NT >= k1 - k0 rows staged, in groups of SG
    column tiles whose loads are all in flight together). A DOWN_PROJ half's act columns: the staging buffer then
    needs only the widest half's rows (``dot_tile`` with REBASE reads row k - k0)."""
    SG: gl.constexpr = C.SG
    for g0 in gl.static_range(0, NT, SG):
        o = k0 * C.TK + _group_offsets(g0, C)
        v = gl.load(src_ptr + o, mask=(o < K) & (o < k1 * C.TK), other=0.0, cache_modifier=".cg")
        _group(hbuf, g0, SG).store(v.to(gl.bfloat16))
    gl.thread_barrier()


@gluon.jit
def residual_rows(sm, it, k0, k1, row0, n_tiles, x_ptr, res_ptr, res_from_embed, C: gl.constexpr):
    """O_PROJ / DOWN_PROJ: x[rows] = residual[rows] + W[rows] . h over column tiles [k0, k1), tile by tile (the
    residual is x itself, or for layer 0's O_PROJ the bf16 embedding row). Each row tile's residual is requested
    before its dot product, so its round trip overlaps the tile loop."""
    offs_r = gl.arange(0, C.TR, gl.SliceLayout(1, layouts.tile(C)))
    for r in range(n_tiles):
        rows = row0 + r * C.TR + offs_r
        if res_from_embed:
            res = gl.load(res_ptr + rows).to(gl.float32)
        else:
            res = gl.load(x_ptr + rows, cache_modifier=".cg")
        acc, it = dot_tile(sm, it, k0, k1, C)
        gl.store(x_ptr + rows, res + acc)
    return it


@gluon.jit
def swiglu_rows(sm, it, k0, k1, n_tiles, out_ptr, C: gl.constexpr):
    """MLP_IN / EXPERT_IN: each row tile holds TR/2 gate rows over the same TR/2 up rows; out[r * TR/2 + j] =
    SiLU(gate_j . h) * (up_j . h) for row tile r, over column tiles [k0, k1)."""
    TH: gl.constexpr = C.TR // 2
    for t in range(n_tiles):
        acc, it = dot_tile(sm, it, k0, k1, C)
        a2 = gl.reshape(acc, [2, TH])  # row h * TR/2 + j -> [h, j]: h = 0 gate, 1 up
        h = gl.expand_dims(gl.arange(0, 2, gl.SliceLayout(1, a2.type.layout)), 1)
        g = gl.sum(gl.where(h == 0, a2, 0.0), axis=0)
        u = gl.sum(gl.where(h == 1, a2, 0.0), axis=0)
        offs = gl.arange(0, TH, g.type.layout)
        gl.store(out_ptr + t * TH + offs, g / (1.0 + gl.exp(-g)) * u)
    return it
