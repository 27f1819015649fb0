"""The multi-token matvec (C.M > 1, a decode batch): staging M tokens' inputs, and swap-AB wgmma over weight tiles.

The design of tools/skinny_gemm.py's probe ``skinny_gemm_swap`` (not yet run on a GPU), inside the megakernel's ring:
  * the staging buffer ``xs`` holds the instruction's input for the MB = 8 padded tokens as bf16 chunks
    [MB, 32] (one chunk a 32-column slice; column tile k is chunks 8k .. 8k + 7; rows past M and columns past K
    zero), staged once per run of same-stage instructions, RMSNorm per token where the instruction normalises x;
  * a ring slot holds a [32, 256] tile chunk-major ([256, 32]: row 32j + r = W[r, 32j .. 32j + 32), launch/pack.py),
    so rows [64q, 64q + 64) are chunks 2q and 2q + 1 of all 32 tile rows: wgmma's 64-row A operand, read in place;
  * chunk c of the tokens (``xs.index(c).permute((1, 0))``, [32, MB]) is the narrow B operand: an A pair against
    its even chunk accumulates into rows 0..31 of ``acc_e``, against its odd chunk into rows 32..63 of ``acc_o``
    (the other half of each product is unused); a row tile's sum is acc_e[r] + acc_o[32 + r];
  * one tile's wgmmas stay in flight while the next tile's issue (``warpgroup_mma_wait(num_outstanding=NF)``); a
    slot goes back to the loader once its wgmmas completed.
PyTorch references: each instruction's ``ops`` module (the same solvers as M = 1, over M rows).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait


@constexpr_function
def xs_layout(C):
    """The staging buffer's shared layout: wgmma's B operand, one [MB, 32] chunk an index."""
    return gl.NVMMASharedLayout.get_default_for([C.MB, 32], gl.bfloat16)


@constexpr_function
def chunk_layout(C):
    """[MB, 32]: one staged chunk over the compute warps, two columns a thread."""
    return gl.BlockedLayout([1, 2], [4, 8], [2, C.NW // 2], [1, 0])


@constexpr_function
def group_chunks(C):
    """Chunks staged per round of loads: two column tiles of MB tokens (4096 elements: 32 fp32 registers a thread,
    as the one-token staging's groups), one where the buffer holds a single column tile."""
    return (C.TK // 32) * min(2, C.KT_ROWS)


@constexpr_function
def out_layout(C):
    """[TR, MB]: a row tile's sums for every token, one row a lane."""
    return gl.BlockedLayout([1, C.MB], [32, 1], [C.NW, 1], [1, 0])


@gluon.jit
def _chunk_index(C: gl.constexpr):
    L: gl.constexpr = chunk_layout(C)
    t = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(1, L)), 1)
    c = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, L)), 0)
    return t, c


@gluon.jit
def _load_row(x_ptr, emb_ptr, tok, from_embed, t, o, ok, K):
    """Columns ``o`` of token t's residual row: x[t] (fp32, written by other CTAs this step: through L2), or for
    layer 0 its embedding row (bf16; ``tok`` its id)."""
    if from_embed:
        v = gl.load(emb_ptr + tok.to(gl.int64) * K + o, mask=ok, other=0.0).to(gl.float32)
    else:
        v = gl.load(x_ptr + t * K + o, mask=ok, other=0.0, cache_modifier=".cg")
    return v


@gluon.jit
def stage_normed(xs, x_ptr, emb_ptr, tok_ptr, from_embed, norm_ptr, K, eps, KT: gl.constexpr, C: gl.constexpr):
    """xs <- per token (x * rsqrt(mean(x^2) + eps)).to(bf16) * norm_w, x = token t's fp32 residual row or (layer 0)
    its bf16 embedding row; rows past M and columns past K zero. Two passes over x: the sums of squares, then the
    scaled chunks; each in rounds of ``group_chunks`` chunks whose loads are all in flight together (unrolled)."""
    NCH: gl.constexpr = KT * (C.TK // 32)
    NCG: gl.constexpr = group_chunks(C)
    t, c = _chunk_index(C)
    tok = gl.load(tok_ptr + t, mask=t < C.M, other=0)
    MB: gl.constexpr = C.MB
    ss = gl.zeros([MB, 32], gl.float32, chunk_layout(C))
    for g in range(0, NCH, NCG):
        for j in gl.static_range(NCG):
            o = (g + j) * 32 + c
            v = _load_row(x_ptr, emb_ptr, tok, from_embed, t, o, (t < C.M) & (o < K), K)
            ss += v * v
    rs = gl.expand_dims(gl.rsqrt(gl.sum(ss, axis=1) / K + eps), 1)
    for g in range(0, NCH, NCG):
        for j in gl.static_range(NCG):
            o = (g + j) * 32 + c
            v = _load_row(x_ptr, emb_ptr, tok, from_embed, t, o, (t < C.M) & (o < K), K)
            w = gl.load(norm_ptr + o, mask=o < K, other=0.0)
            xs.index(g + j).store((v * rs).to(gl.bfloat16) * w)
    fence_async_shared()  # the generic-proxy stores before the async proxy (wgmma) reads them
    gl.thread_barrier()


@gluon.jit
def stage_span(xs, src_ptr, K, k0, k1, C: gl.constexpr):
    """xs chunks 0 .. 8 (k1 - k0) <- column tiles [k0, k1) of src [M, K] (fp32 activations written by other CTAs
    this step) rounded to bf16; rows past M and columns past K or k1 zero, in rounds of ``group_chunks`` chunks
    whose loads are all in flight together (a round may stage one column tile past k1 - k0: zeros, inside the
    buffer, whose power-of-two column tiles hold any odd span plus one). Column tile k is read by ``dot_tile`` with
    ``k0`` as its base."""
    NCG: gl.constexpr = group_chunks(C)
    t, c = _chunk_index(C)
    end = gl.minimum(k1 * C.TK, K)
    for g in range(0, (k1 - k0) * (C.TK // 32), NCG):
        for j in gl.static_range(NCG):
            o = k0 * C.TK + (g + j) * 32 + c
            v = gl.load(src_ptr + t * K + o, mask=(t < C.M) & (o < end), other=0.0, cache_modifier=".cg")
            xs.index(g + j).store(v.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def dot_tile(sm, it, k0, k1, base, C: gl.constexpr):
    """One row tile for every token: sum over column tiles [k0, k1) of W_tile . x_chunk -> ([TR, MB] fp32 in
    ``out_layout``, it'), column tile k's chunks staged at xs chunks 8 (k - base) ... Swap-AB wgmma (module doc)."""
    bufs = sm.bufs
    xs = sm.hbuf
    NB: gl.constexpr = C.NB
    NF: gl.constexpr = C.TK // 32
    MB: gl.constexpr = C.MB
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[C.NW, 1],
                                                  instr_shape=[16, MB, 16])
    acc_e = gl.zeros([64, MB], gl.float32, ACC)  # rows 0..31: the even chunks' sums
    acc_o = gl.zeros([64, MB], gl.float32, ACC)  # rows 32..63: the odd chunks' sums
    prev = 0
    for k in range(k0, k1):
        idx = it % NB
        mbarrier.wait(sm.ready.index(idx), (it // NB) & 1)
        slot = bufs.index(idx)
        c0 = (k - base) * NF
        for q in gl.static_range(NF // 2):
            a = slot.slice(q * 64, 64)  # chunks 2q (rows 0..31) and 2q + 1 (rows 32..63) of the tile's rows
            acc_e = warpgroup_mma(a, xs.index(c0 + 2 * q).permute((1, 0)), acc_e, is_async=True)
            acc_o = warpgroup_mma(a, xs.index(c0 + 2 * q + 1).permute((1, 0)), acc_o, is_async=True)
        # this tile's wgmmas stay in flight; the previous tile's completed: its slot goes back
        acc_e, acc_o = warpgroup_mma_wait(num_outstanding=NF, deps=(acc_e, acc_o))
        if k > k0:
            mbarrier.arrive(sm.empty.index(prev), count=1)
        prev = idx
        it += 1
    acc_e, acc_o = warpgroup_mma_wait(num_outstanding=0, deps=(acc_e, acc_o))
    if k1 > k0:
        mbarrier.arrive(sm.empty.index(prev), count=1)
    r = gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(1, ACC)), 1)
    y = gl.where(r < 32, acc_e, acc_o)  # [64, MB]: the even chunks' sums over the odd chunks'
    y3 = gl.reshape(y, [2, 32, MB])
    return gl.convert_layout(gl.sum(y3, axis=0), out_layout(C)), it


@gluon.jit
def tile_index(row0, C: gl.constexpr):
    """([TR, 1] rows from row0, [1, MB] tokens) in ``out_layout``."""
    L: gl.constexpr = out_layout(C)
    rows = gl.expand_dims(row0 + gl.arange(0, C.TR, gl.SliceLayout(1, L)), 1)
    t = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(0, L)), 0)
    return rows, t


@gluon.jit
def residual_rows(sm, it, k0, k1, base, row0, n_tiles, x_ptr, emb_ptr, tok_ptr, res_from_embed,
                  C: gl.constexpr):
    """O_PROJ / DOWN_PROJ for every token: x[t, rows] = residual[t, rows] + W[rows] . h_t over column tiles
    [k0, k1) (the residual is x itself, or for layer 0's O_PROJ token t's bf16 embedding row). Each row tile's
    residual is requested before its dot product."""
    for r in range(n_tiles):
        rows, t = tile_index(row0 + r * C.TR, C)
        ok = (t < C.M) & (rows >= 0)
        if res_from_embed:
            tok = gl.load(tok_ptr + t, mask=t < C.M, other=0)
            res = gl.load(emb_ptr + tok.to(gl.int64) * C.D + rows, mask=ok, other=0.0).to(gl.float32)
        else:
            res = gl.load(x_ptr + t * C.D + rows, mask=ok, other=0.0, cache_modifier=".cg")
        acc, it = dot_tile(sm, it, k0, k1, base, C)
        gl.store(x_ptr + t * C.D + rows, res + acc, mask=ok)
    return it


@gluon.jit
def part_rows(sm, it, k0, k1, base, row0, n_tiles, out_ptr, N, C: gl.constexpr):
    """A column part's sums for every token: out[t, rows] = W[rows, column tiles k0..k1) . h_t (out [M, N] fp32;
    column tile k staged at chunk 8 (k - base))."""
    for r in range(n_tiles):
        rows, t = tile_index(row0 + r * C.TR, C)
        acc, it = dot_tile(sm, it, k0, k1, base, C)
        gl.store(out_ptr + t * N + rows, acc, mask=(t < C.M) & (rows >= 0))
    return it
