"""The multi-token matvec (C.M > 1, a decode batch): staging M tokens' inputs, and swap-AB wgmma over weight tiles.

The design of tools/skinny_gemm.py's probe ``skinny_gemm_swap`` inside the megakernel's ring, a chunk pair a wgmma:
  * the staging buffer ``xs`` holds the instruction's input for the MB = 8 padded tokens as bf16 chunks
    [MB, 32] (one chunk a 32-column slice; column tile k is chunks 8k .. 8k + 7; rows past M and columns past K
    zero), staged once per run of same-stage instructions by ONE round of async copies (cp.async) from the bf16
    sources the producers write (state.py: x16, attn16, act16; layer 0's embedding rows), RMSNorm per token then
    in shared memory where the instruction normalises x. A load round trip to L2 waits behind this SM's own weight
    tiles in flight (~2.5 us on an H100: bench/NOTES.md), so an instruction's staging makes one round trip, not one
    per round of register loads;
  * a ring slot holds a [32, 256] tile chunk-major ([256, 32]: row 32j + r = W[r, 32j .. 32j + 32), launch/pack.py),
    so rows [64q, 64q + 64) are chunks 2q and 2q + 1 of all 32 tile rows: wgmma's 64-row A operand, read in place;
  * the tokens' chunks 2q and 2q + 1 side by side (``pairs(xs)``: two consecutive [MB, 32] chunks are one
    [2 MB, 32] tile, the same bytes) are the narrow B operand [32, 2 MB], so each A pair is read by ONE wgmma
    (m64 n2MB k16 x 2) into ``acc`` [64, 2 MB]: rows 0..31 x columns 0..MB-1 hold the even chunk's products, rows
    32..63 x columns MB..2MB-1 the odd chunk's (the other two quarters are unused); a row tile's sum for token t is
    acc[r, t] + acc[32 + r, MB + t] (``fold``: the column halves in registers, then the row halves across warps);
  * one tile's wgmmas stay in flight while the next tile's issue (``warpgroup_mma_wait(num_outstanding=NF/2)``); a
    slot goes back to the loader once its wgmmas completed.
PyTorch references: each instruction's ``ops`` module (the same solvers as M = 1, over M rows); ``dot_tile_torch``
does ``dot_tile``'s operand arithmetic (pairs, products, fold) in PyTorch.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.ampere import async_copy
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
    """[TR, MB]: a row tile's sums for every token, one row a lane (MB <= 16), or at MB = 32 eight tokens a thread,
    four lanes a row (32 registers a thread would spill)."""
    if C.MB <= 16:
        return gl.BlockedLayout([1, C.MB], [32, 1], [C.NW, 1], [1, 0])
    return gl.BlockedLayout([1, 8], [32 // (C.MB // 8), C.MB // 8], [C.NW, 1], [1, 0])


@gluon.jit
def _chunk_index(C: gl.constexpr):
    L: gl.constexpr = chunk_layout(C)
    t = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(1, L)), 1)
    c = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, L)), 0)
    return t, c


@constexpr_function
def copy_layout(C):
    """[NCG * MB, 32]: one round of chunks (row c * MB + t: chunk c of token t) for the async copies, 8 contiguous
    bf16 (16 bytes, one cp.async) a thread."""
    return gl.BlockedLayout([1, 8], [8, 4], [C.NW, 1], [1, 0])


@constexpr_function
def _round_up(n, k):
    return -(-n // k) * k


@constexpr_function
def wbuf_rows(C):
    """Rows of the norm weights' buffer: the hidden size's 32-column chunks, a power of two (one copy round)."""
    n = C.KT_D * (C.TK // 32)
    return 1 << (n - 1).bit_length()


@constexpr_function
def norm_pass(C, KT):
    """Chunks of a norm's shared-memory passes an iteration (``stage_normed``, its input ``KT`` column tiles): a round
    of chunks (their loads in flight together), 4 at MB = 32 (a chunk is 8 registers a thread there), and never more
    than the input's chunks, so that the passes read no chunk past ``wbuf_rows`` (a hidden size of one column tile
    has 8 chunks of norm weights, a round 16)."""
    n = KT * (C.TK // 32)
    return min(group_chunks(C) if C.MB <= 16 else 4, n)


def norm_reads(C) -> int:
    """Chunks of xs and of the norm weights' buffer that ``stage_normed``'s passes over the hidden size read: its
    chunks rounded up to whole passes (host check against ``wbuf_rows`` and the staging buffer)."""
    n, su = C.KT_D * (C.TK // 32), norm_pass(C, C.KT_D)
    return -(-n // su) * su


@constexpr_function
def wbuf_layout(C):
    """The norm weights' buffer [wbuf_rows, 32], unswizzled; ``stage_normed`` reads it as [wbuf_rows, 1, 32]: chunk
    c is ``index(c)``, a [1, 32] row."""
    return gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])


@gluon.jit
def _flat(xs, C: gl.constexpr):
    """The staging buffer as one [chunks * MB, 32] matrix (row c * MB + t): the same bytes, since a chunk of MB = 8
    rows of 64 bytes is exactly one 64-byte swizzle pattern, so the async copies can take constant row slices."""
    return xs._reinterpret(gl.bfloat16, [C.KT_ROWS * (C.TK // 32) * C.MB, 32], xs_layout(C))


@gluon.jit
def _copy_index(C: gl.constexpr):
    """([NCG * MB, 1] chunk of the round, [NCG * MB, 1] token, [1, 32] column) in ``copy_layout``."""
    L: gl.constexpr = copy_layout(C)
    r = gl.expand_dims(gl.arange(0, group_chunks(C) * C.MB, gl.SliceLayout(1, L)), 1)
    j = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, L)), 0)
    return r // C.MB, r % C.MB, j


@gluon.jit
def _copy_chunks(xs, rows, col0, end, n_chunks, NCH: gl.constexpr, C: gl.constexpr):
    """Async copies into xs chunks [0, NCH) (a multiple of a round, inside the buffer; unrolled: a shared-memory
    slice starts at a constant): chunk c < n_chunks of token t <- rows[t] + col0 + 32c .. + 32 (``rows`` in the
    token's index layout), bf16; chunks past n_chunks, whole chunks at or past ``end`` (a multiple of 32) and
    padding tokens zero-filled. Not committed or waited for."""
    NCG: gl.constexpr = group_chunks(C)
    MB: gl.constexpr = C.MB
    flat = _flat(xs, C)
    c, t, j = _copy_index(C)
    for g in gl.static_range(0, NCH, NCG):
        first = col0 + (g + c) * 32
        ok = (t < C.M) & (g + c < n_chunks) & (first < end) & (j >= 0)
        async_copy.async_copy_global_to_shared(flat.slice(g * MB, NCG * MB), rows + first + j, mask=ok,
                                               cache_modifier=".cg")


@gluon.jit
def _copied(C: gl.constexpr):
    """Wait for this thread's copies, then make every thread's visible to the CTA and to wgmma (async proxy)."""
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def stage_normed(xs, wbuf, x16_ptr, emb_ptr, tok_ptr, from_embed, norm_ptr, K, eps, KT: gl.constexpr,
                 C: gl.constexpr):
    """xs <- per token (x * rsqrt(mean(x^2) + eps)).to(bf16) * norm_w, x = token t's bf16 residual row (x16) or (layer
    0) its bf16 embedding row; rows past M and columns past K zero. One round of async copies brings the rows and
    the norm weights (into ``wbuf``), then two passes over shared memory: the sums of squares, then the scaling in
    place (each thread rewrites the elements it read)."""
    NCH: gl.constexpr = KT * (C.TK // 32)
    NCG: gl.constexpr = group_chunks(C)
    c, t, j = _copy_index(C)
    if from_embed:
        tok = gl.load(tok_ptr + t, mask=t < C.M, other=0)
        rows = emb_ptr + tok.to(gl.int64) * K
    else:
        rows = x16_ptr + t * K
    _copy_chunks(xs, rows, 0, K, NCH, _round_up(NCH, NCG), C)
    WR: gl.constexpr = wbuf_rows(C)
    wr = gl.expand_dims(gl.arange(0, WR, gl.SliceLayout(1, copy_layout(C))), 1) * 32
    async_copy.async_copy_global_to_shared(wbuf, norm_ptr + wr + j, mask=(wr < K) & (j >= 0))
    wrows = wbuf._reinterpret(gl.bfloat16, [WR, 1, 32], wbuf_layout(C))
    _copied(C)
    L: gl.constexpr = chunk_layout(C)
    MB: gl.constexpr = C.MB
    ss = gl.zeros([MB, 32], gl.float32, L)
    # the shared-memory passes: a round of chunks an iteration (their loads in flight together), at most NCH
    SU: gl.constexpr = norm_pass(C, KT)
    for g in range(0, NCH, SU):
        for q in gl.static_range(SU):
            v = xs.index(g + q).load(L).to(gl.float32)
            ss += v * v
    rs = gl.expand_dims(gl.rsqrt(gl.sum(ss, axis=1) / K + eps), 1)
    for g in range(0, NCH, SU):
        for q in gl.static_range(SU):
            v = xs.index(g + q).load(L).to(gl.float32)
            w = wrows.index(g + q).load(L)  # [1, 32]: broadcast over the tokens
            xs.index(g + q).store((v * rs).to(gl.bfloat16) * w)
    fence_async_shared()  # the generic-proxy stores before the async proxy (wgmma) reads them
    gl.thread_barrier()


@gluon.jit
def stage_span(xs, src_ptr, K, k0, k1, C: gl.constexpr):
    """xs chunks 0 .. 8 (k1 - k0) <- column tiles [k0, k1) of src [M, K] (bf16 activations written by other CTAs
    this step), in one round of async copies; rows past M and columns past K or k1 zero (a round may stage one
    column tile past k1 - k0: zeros, inside the buffer, whose power-of-two column tiles hold any odd span plus
    one). Column tile k is read by ``dot_tile`` with ``k0`` as its base."""
    c, t, j = _copy_index(C)
    _copy_chunks(xs, src_ptr + t * K, k0 * C.TK, gl.minimum(k1 * C.TK, K), (k1 - k0) * (C.TK // 32),
                 C.KT_ROWS * (C.TK // 32), C)
    _copied(C)


@gluon.jit
def pairs(xs, C: gl.constexpr):
    """The staging buffer as [chunks / 2, 2 MB, 32]: pair p is chunks 2p (rows 0..MB-1) and 2p + 1 (rows MB..2MB-1),
    the same bytes (a chunk of MB >= 8 rows of 64 bytes is whole 64-byte swizzle patterns, and the layout of a
    [2 MB, 32] tile is a [MB, 32] chunk's: xs_layout)."""
    return xs._reinterpret(gl.bfloat16, [C.KT_ROWS * (C.TK // 64), 2 * C.MB, 32], xs_layout(C))


@gluon.jit
def fold(acc, C: gl.constexpr):
    """[64, 2 MB] pair products -> [TR, MB] row sums in ``out_layout``: y[r, t] = acc[r, t] + acc[32 + r, MB + t].
    The column halves first: in wgmma's accumulator layout column MB is a register bit (MB >= 8), so picking each
    row's half is a select in registers and halves what the row fold moves; the row halves are warps 0-1 against
    2-3, summed through shared memory as a [64, MB] accumulator's were."""
    MB: gl.constexpr = C.MB
    lo, hi = gl.split(gl.permute(gl.reshape(acc, [64, 2, MB]), (0, 2, 1)))  # [64, MB] each: columns t, MB + t
    r = gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(1, lo.type.layout)), 1)
    y = gl.where(r < 32, lo, hi)  # [64, MB]: the even chunks' sums over the odd chunks'
    return gl.convert_layout(gl.sum(gl.reshape(y, [2, 32, MB]), axis=0), out_layout(C))


@gluon.jit
def dot_tile(sm, it, k0, k1, base, C: gl.constexpr):
    """One row tile for every token: sum over column tiles [k0, k1) of W_tile . x_chunk -> ([TR, MB] fp32 in
    ``out_layout``, it'), column tile k's chunks staged at xs chunks 8 (k - base) ... Swap-AB wgmma, one a chunk
    pair (module doc)."""
    bufs = sm.bufs
    xs = pairs(sm.hbuf, C)
    NB: gl.constexpr = C.NB
    NP: gl.constexpr = C.TK // 64  # chunk pairs a tile: its wgmmas
    MB: gl.constexpr = C.MB
    gl.static_assert((C.TR == 32) & (C.TK % 64 == 0), "a tile's chunk pairs are wgmma's 64-row A operands")
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[C.NW, 1],
                                                  instr_shape=[16, 2 * MB, 16])
    acc = gl.zeros([64, 2 * MB], gl.float32, ACC)  # [even chunks' rows | odd chunks' rows] x [even | odd tokens]
    prev = 0
    for k in range(k0, k1):
        idx = it % NB
        mbarrier.wait(sm.ready.index(idx), (it // NB) & 1)
        slot = bufs.index(idx)
        p0 = (k - base) * NP
        for q in gl.static_range(NP):
            a = slot.slice(q * 64, 64)  # chunks 2q (rows 0..31) and 2q + 1 (rows 32..63) of the tile's rows
            acc = warpgroup_mma(a, xs.index(p0 + q).permute((1, 0)), acc, is_async=True)
        # this tile's wgmmas stay in flight; the previous tile's completed: its slot goes back
        acc = warpgroup_mma_wait(num_outstanding=NP, deps=(acc,))
        if k > k0:
            mbarrier.arrive(sm.empty.index(prev), count=1)
        prev = idx
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if k1 > k0:
        mbarrier.arrive(sm.empty.index(prev), count=1)
    return fold(acc, C), it


@gluon.jit
def tile_index(row0, C: gl.constexpr):
    """([TR, 1] rows from row0, [1, MB] tokens) in ``out_layout``."""
    L: gl.constexpr = out_layout(C)
    rows = gl.expand_dims(row0 + gl.arange(0, C.TR, gl.SliceLayout(1, L)), 1)
    t = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(0, L)), 0)
    return rows, t


@gluon.jit
def residual_rows(sm, it, k0, k1, base, row0, n_tiles, x_ptr, x16_ptr, emb_ptr, tok_ptr, res_from_embed,
                  C: gl.constexpr):
    """O_PROJ / DOWN_PROJ for every token: x[t, rows] = residual[t, rows] + W[rows] . h_t over column tiles
    [k0, k1) (the residual is x itself, or for layer 0's O_PROJ token t's bf16 embedding row), and its bf16 copy
    x16. Each row tile's residual is requested before its dot product."""
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
        gl.store(x16_ptr + t * C.D + rows, (res + acc).to(gl.bfloat16), mask=ok)
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


@gluon.jit
def swiglu_rows(sm, it, k0, k1, n_tiles, out_ptr, N, C: gl.constexpr):
    """MLP_IN / EXPERT_IN for every token: a tile's [TR, MB] sums are TR/2 gate rows over the same TR/2 up rows;
    out[t, r * TR/2 + j] = SiLU(gate_j . h_t) * (up_j . h_t) in bf16 (out [M, N], as DOWN_PROJ / EXPERT_DOWN stage
    it), row tile r, column tiles [k0, k1)."""
    TH: gl.constexpr = C.TR // 2
    MB: gl.constexpr = C.MB
    GL: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [C.NW, 1], [1, 0])  # [TH, MB]
    j = gl.expand_dims(gl.arange(0, TH, gl.SliceLayout(1, GL)), 1)
    t = gl.expand_dims(gl.arange(0, C.MB, gl.SliceLayout(0, GL)), 0)
    for r in range(n_tiles):
        acc, it = dot_tile(sm, it, k0, k1, 0, C)
        a3 = gl.reshape(acc, [2, TH, MB])  # row h * TR/2 + j -> [h, j]: h = 0 gate, 1 up
        L3: gl.constexpr = a3.type.layout
        h = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, gl.SliceLayout(1, gl.SliceLayout(2, L3))), 1), 2)
        g = gl.convert_layout(gl.sum(gl.where(h == 0, a3, 0.0), axis=0), GL)
        u = gl.convert_layout(gl.sum(gl.where(h == 1, a3, 0.0), axis=0), GL)
        gl.store(out_ptr + t * N + r * TH + j, (g / (1.0 + gl.exp(-g)) * u).to(gl.bfloat16),
                 mask=(t < C.M) & (j >= 0))
    return it


def staged_torch(x: torch.Tensor, MB: int, n_chunks: int) -> torch.Tensor:
    """The staging buffer as ``stage_span`` leaves it, flat [n_chunks * MB, 32]: row c * MB + t is token t's columns
    [32c, 32c + 32) (tokens past M = x.shape[0] and columns past K = x.shape[1] zero)."""
    m, k = x.shape
    xp = torch.zeros(MB, n_chunks * 32, dtype=x.dtype)
    xp[:m, :k] = x
    return xp.view(MB, n_chunks, 32).transpose(0, 1).reshape(n_chunks * MB, 32)


def fold_torch(acc: torch.Tensor, MB: int) -> torch.Tensor:
    """``fold``: [64, 2 MB] -> [32, MB], y[r, t] = acc[r, t] + acc[32 + r, MB + t], the column halves first."""
    y = torch.where(torch.arange(64)[:, None] < 32, acc[:, :MB], acc[:, MB:])
    return y[:32] + y[32:]


def dot_tile_torch(slots: torch.Tensor, xs: torch.Tensor, MB: int) -> torch.Tensor:
    """``dot_tile``'s operands and products in PyTorch (fp32), for column tiles staged from chunk 0 (base = k0):
    slots [KT, TR * TK / 32, 32] one row tile's column tiles as the ring holds them (launch/pack.tile_major), xs
    the staged chunks flat (``staged_torch``) -> [TR, MB]. One product a chunk pair: A = the slot's rows
    [64q, 64q + 64), B = pair p's [2 MB, 32] transposed."""
    kt, rows, _ = slots.shape
    n_pairs = rows // 64
    xp = xs.view(-1, 2 * MB, 32)  # ``pairs``
    acc = torch.zeros(64, 2 * MB)
    for k in range(kt):
        for q in range(n_pairs):
            acc += slots[k, 64 * q: 64 * q + 64].float() @ xp[k * n_pairs + q].float().T
    return fold_torch(acc, MB)
