"""ATTN_PARTIAL of a query block on the GPU: one split of a verify block's T tokens (T = 2..plan.MAX_QUERY_BLOCK,
consecutive positions of one sequence; program.StepShape.attn_blocks) for the G query heads of one KV head, each
K/V block read once for all T tokens. Its meaning and PyTorch reference are ATTN_PARTIAL's (attn_partial.solve /
finish, the block's tokens as the instruction's query tokens); this is the device code, which attn_partial.compute
runs for an instruction whose block has more than one token.

Query rows: R = QT x GP (the block's tokens padded to the plan's QT, the group's heads to GP; at least 16 a
warp), row r = token r // GP, head r % GP; rows past the block's tokens or the group's heads load q = 0, are masked
out of every score and never stored. A K/V block of BT
positions gives S = Q K^T [R, BT] and, after the online softmax (per row, base-2 domain: q pre-scaled by
head_dim^-0.5 * log2(e), as the one-token path), O += P V [R, HD], both on mma.sync (m16n8k16, bf16 operands,
fp32 accumulate): a thread holds its rows' states, so nothing merges across warps at the end. Causal mask per row:
key position <= the row's token position (the block's own rows are keys of its later tokens), and < the split's
end.

q [R, HD] bf16 (pre-scaled) and the K/V blocks live in the staging buffer (free during attention): q first, then
two stages of a K and a V block of QBT positions (plan.query_block: 32, or 16 where the buffer is small), filled by
16-byte cp.async copies and swizzled so the operand loads of a row block meet no bank conflict. Blocks 0 and 1 are
requested before the dependency wait, their rows below ``first`` (the first position this step writes in the
sequence: state.seg_new) only; the split holding rows at or past it requests those two blocks again, whole, once
the wait is met (ATTN_IN stored them before it signalled). Block b + 2 goes into block b's stage once every warp has
read it: the mma operands span the warps' copies, so each block is bracketed by two partition barriers (its copies
visible; its reads done). A block is consumed in sub-blocks of 32 keys (head_dim 64) or 16 (128), S over head_dim
in chunks of 32, so no operand holds more than 32 registers a thread. The stages' last copies (past the split:
zero-filled) land before the instruction ends, when the next one's staging may write the buffer.

Partials stay per token (state.py's part_o / part_ml rows of each token); the split that draws the ticket last
combines every token of the block (``_combine``: per token the math of attn_partial._reduce), their partials through
cp.async stages in the staging buffer, two tokens ahead where two fit.

The path is three functions of their own (noinline), called with a few values (``Block``) by
attn_partial._compute_block: ``request_block`` (blocks 0 and 1, before the dependency wait), ``compute_block`` (the
partial) and ``combine_block``; their registers are allocated apart from the rest of the kernel, which sits at 255
(inlined, the path pushed the other instructions' paths into spills; tests/megakernel/test_kernel_compile_batch.py
checks both). A noinline function's barriers are not the compute partition's (device/sync.py: Triton leaves them
CTA-wide, and the loader's warps never reach them): the dependency wait and the ticket (scalar atomics, broadcast
through a barrier) stay in the caller, and these functions sync only through sync.partition_barrier and wait for
their copies through sync.copies_landed (Gluon's wait_group adds a barrier); the compile test checks that no
barrier of the kernel is CTA-wide.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.core import _aggregate as aggregate

from ..device.sync import copies_landed, partition_barrier
from ..state import EMPTY_M

LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
EMPTY_M_D: gl.constexpr = gl.constexpr(EMPTY_M)


@constexpr_function
def rows(C):
    """R: the query rows, the plan's QT tokens x GP heads, at least one m16 row block a warp (plan.query_block)."""
    return max(16 * C.NW, C.QT * C.GP)


@constexpr_function
def mma_layout(C):
    """The accumulators' layout [R, n]: m16n8 tiles, the warps over the rows (16 rows a warp, or more), so a row's
    softmax state stays in one warp's registers."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[C.NW, 1], instr_shape=[16, 8])


@constexpr_function
def copy_layout(C):
    """[BT, HD] copies: 16-byte vectors (8 bf16, or 16 e4m3 where C.FP8), a row's vectors over HD / VEC lanes, rows
    over the rest and the warps."""
    vec = 16 if C.FP8 else 8
    tpr = min(32, C.HD // vec)
    return gl.BlockedLayout([1, vec], [32 // tpr, tpr], [C.NW, 1], [1, 0])


@constexpr_function
def combine_layout(C):
    """[GP, SP2, 32]: a token's partials, 32 columns of them: a head a warp, the lanes over the splits and then the
    columns (SP2 <= 32), the rest of the 32 columns in a thread's registers (SP2 of them, contiguous)."""
    return gl.BlockedLayout([1, 1, C.SP2], [1, C.SP2, 32 // C.SP2], [C.NW, 1, 1], [2, 1, 0])


@constexpr_function
def stage_layout(C):
    """A stage's [BT, HD] rows in shared memory: 16-byte vectors swizzled over eight rows, so the operand loads of
    a row block (K^T: eight keys' rows at once) spread over the banks."""
    return gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])


@aggregate
class Block:
    """What a query block's split reads and writes beyond its words: the step's arrays and counters, the scratch
    and cache pointers, the staging buffer; the few values the noinline functions are called with, rather than
    the kernel's whole state."""
    cnt: gl.tensor
    epoch: gl.tensor
    poss: gl.tensor
    news: gl.tensor
    bt: gl.tensor
    maxp: gl.tensor | gl.constexpr
    q: gl.tensor
    po: gl.tensor
    pml: gl.tensor
    kc: gl.tensor
    vc: gl.tensor
    ksc: gl.tensor
    vsc: gl.tensor
    attn16: gl.tensor
    splits: gl.tensor | gl.constexpr
    num_pages: gl.tensor | gl.constexpr
    qscale: gl.tensor
    hbuf: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, s, b, sm):
        self.cnt = s.cnt
        self.epoch = s.epoch
        self.poss = s.poss
        self.news = s.news
        self.bt = s.bt
        self.maxp = s.maxp
        self.q = b.q
        self.po = b.po
        self.pml = b.pml
        self.kc = b.kc
        self.vc = b.vc
        self.ksc = b.ksc
        self.vsc = b.vsc
        self.attn16 = b.attn16
        self.splits = b.splits
        self.num_pages = b.num_pages
        self.qscale = b.qscale
        self.hbuf = sm.hbuf


@gluon.jit
def _range(seg, nt, split, n_splits, b):
    """The split's positions [lo, hi) (state.split_range(p0 + nt, split, n_splits, nt): the p0 past positions in
    chunks, the last split also the block's own rows) and ``pre``: rows below it do not depend on this step (``first``,
    the first position this step writes in the sequence: state.seg_new). Returns (p0, lo, hi, pre)."""
    p0 = gl.load(b.poss + seg)  # the block's first position: its tokens are at p0 .. p0 + nt - 1
    first = gl.load(b.news + seg)
    chunk = (p0 + n_splits - 1) // n_splits
    lo = gl.minimum(split * chunk, p0)
    hi = gl.where(split == n_splits - 1, p0 + nt, gl.minimum(lo + chunk, p0))
    return p0, lo, hi, gl.minimum(hi, first)


@gluon.jit
def _stages(b, C: gl.constexpr):
    """The staging buffer as [QU + 4, QBT, HD] bf16 blocks: q's QU blocks, then two stages of a K and a V block;
    returns (the blocks, QU)."""
    BT: gl.constexpr = C.QBT
    HD: gl.constexpr = C.HD
    QU: gl.constexpr = (rows(C) + BT - 1) // BT
    gl.static_assert((QU + 4) * BT * HD * 2 <= b.hbuf.type.shape[0] * b.hbuf.type.shape[1] * b.hbuf.type.shape[2] * 2,
                     "the staging buffer must hold q and two stages of K/V blocks")
    return b.hbuf._reinterpret(gl.bfloat16, [QU + 4, BT, HD], stage_layout(C)), QU


@gluon.jit
def _offsets(C: gl.constexpr):
    """A copy's [BT, 1] position and [1, HD] column offsets."""
    CP: gl.constexpr = copy_layout(C)
    tk = gl.expand_dims(gl.arange(0, C.QBT, gl.SliceLayout(1, CP)), 1)
    dk = gl.expand_dims(gl.arange(0, C.HD, gl.SliceLayout(0, CP)), 0)
    return tk, dk


@gluon.jit(noinline=True)
def request_block(layer, kvh, seg, nt, split, n_splits, b, C: gl.constexpr):
    """Before the dependency wait: blocks 0 and 1 of the split of the query block of ``nt`` tokens (segments seg ..
    seg + nt - 1) requested into the stages, their rows below ``first`` only (the rest of the step's rows come after
    the wait, ``compute_block``). Two commit groups, no barrier (sync.py: a noinline function of the partition)."""
    p0, lo, hi, pre = _range(seg, nt, split, n_splits, b)
    tk, dk = _offsets(C)
    kvbuf, QU = _stages(b, C)
    bt_row = b.bt + seg * b.maxp
    _copy(kvbuf, QU, b, bt_row, layer, kvh, lo + tk, pre, dk, C)
    _copy(kvbuf, QU + 2, b, bt_row, layer, kvh, lo + C.QBT + tk, pre, dk, C)


@gluon.jit(noinline=True)
def compute_block(layer, kvh, seg, nt, split, n_splits, b, C: gl.constexpr):
    """After the dependency wait, ``request_block``'s two groups in flight: blocks 0 and 1 again where they hold rows
    this step wrote, q staged, and the split's partial of every token (``_partial``). Its barriers are the
    partition's own (sync.partition_barrier); the caller draws the ticket, whose barrier orders the last reads of the
    staging buffer before the combine's copies."""
    BT: gl.constexpr = C.QBT
    p0, lo, hi, pre = _range(seg, nt, split, n_splits, b)
    tk, dk = _offsets(C)
    kvbuf, QU = _stages(b, C)
    bt_row = b.bt + seg * b.maxp
    if pre < gl.minimum(hi, lo + 2 * BT):  # blocks 0 and 1 hold rows this step wrote: both again, whole
        copies_landed(0, C.NW)  # the first copies landed: the second ones' writes (this thread's, the same
        # elements) come after them
        _copy(kvbuf, QU, b, bt_row, layer, kvh, lo + tk, hi, dk, C)
        _copy(kvbuf, QU + 2, b, bt_row, layer, kvh, lo + BT + tk, hi, dk, C)
    _stage_q(b.hbuf._reinterpret(gl.bfloat16, [rows(C), C.HD], stage_layout(C)), kvh, seg, nt, b, C)
    _partial(layer, kvh, seg, nt, split, p0, lo, hi, kvbuf, bt_row, tk, dk, b, C)


@constexpr_function
def combine_stages(hbuf_bytes, stage_bytes, ml_bytes, qt):
    """Stages of the combine's o partials: as many as the staging buffer holds beside the block's (m, l), at most
    the block's tokens and 8 (the commit groups one thread keeps pending)."""
    return max(1, min(qt, 8, (hbuf_bytes - ml_bytes) // stage_bytes))


@gluon.jit(noinline=True)
def combine_block(kvh, seg, nt, n_splits, b, C: gl.constexpr):
    """The split that drew the ticket last: every token of the block combined (``_combine``)."""
    _combine(kvh, seg, nt, n_splits, b, C)


@gluon.jit
def _combine(kvh, seg, nt, n_splits, b, C: gl.constexpr):
    """The combining split: token by token, the G heads of KV group ``kvh`` combined over splits [0, n_splits)
    (attn_partial.combine; per token the math of attn_partial._reduce), stored to the attention output. Everything
    comes through the staging buffer by cp.async: every token's (m, l) first (one group), then a token's o
    partials [GP, SP2, HD] in stages, as many tokens ahead as stages fit (``combine_stages``): each round trip to
    L2 waits behind the SM's weight tiles in flight, so the combine costs about nt / NST round trips. A thread holds
    all the splits of its (head, column) elements, so the sums over splits stay in its registers, and it copies and
    reads back only its own elements (no barrier). A warp holds one head, its lanes over the splits (the sums over
    splits are shuffles) and a chunk of 32 columns: SP2 elements a thread a chunk, so the combine's registers stay
    few."""
    G: gl.constexpr = C.G
    GP: gl.constexpr = C.GP
    HD: gl.constexpr = C.HD
    SP2: gl.constexpr = C.SP2
    NW: gl.constexpr = C.NW
    L3: gl.constexpr = combine_layout(C)  # [GP, SP2, 32] o
    LML: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, SP2, 32 // SP2], [NW, 1, 1], [2, 1, 0])  # [GP, SP2, 2]
    HBUF: gl.constexpr = b.hbuf.type.shape[0] * b.hbuf.type.shape[1] * b.hbuf.type.shape[2] * 2
    STAGE: gl.constexpr = GP * SP2 * HD * 4
    ML: gl.constexpr = C.QT * GP * SP2 * 2 * 4
    NST: gl.constexpr = combine_stages(HBUF, STAGE, ML, C.QT)
    gl.static_assert(STAGE + ML <= HBUF, "the staging buffer must hold a token's partials and the block's (m, l)")
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    obuf = b.hbuf._reinterpret(gl.float32, [NST, GP, SP2, HD], FLAT)
    mlbuf = b.hbuf._reinterpret(gl.float32, [HBUF // (GP * SP2 * 8), GP, SP2, 2], FLAT)
    ML0: gl.constexpr = NST * HD // 2  # the (m, l) area's first entry: past the o stages
    # a token's (m, l) entries [GP, SP2, 2], its part_ml rows kvh * G + g, splits s < n_splits
    mg = gl.arange(0, GP, gl.SliceLayout(1, gl.SliceLayout(2, LML)))
    msp = gl.arange(0, SP2, gl.SliceLayout(0, gl.SliceLayout(2, LML)))
    mk = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, LML))), 0), 1)
    mrow = gl.expand_dims(gl.expand_dims((kvh * G + mg) * b.splits, 1) + gl.expand_dims(msp, 0), 2)
    mok = gl.expand_dims(gl.expand_dims(mg < G, 1) & gl.expand_dims(msp < n_splits, 0), 2)  # [GP, SP2, 1]
    for t in range(nt):
        src = b.pml + (seg + t) * (C.HQ * 2) * b.splits + mrow * 2 + mk
        async_copy.async_copy_global_to_shared(mlbuf.index(ML0 + t), src, mask=mok, cache_modifier=".cg")
    async_copy.commit_group()
    for t in gl.static_range(NST):
        _copy_partials(obuf, t, b, seg + t, kvh, n_splits, t < nt, C)
    og = gl.arange(0, GP, gl.SliceLayout(1, gl.SliceLayout(1, L3)))
    od = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    out = gl.expand_dims((kvh * G + og) * HD, 1) + gl.expand_dims(od, 0)  # [GP, 32]
    out_ok = gl.expand_dims(og < G, 1)  # [GP, 1]: masks broadcast, so a row's columns stay one vector
    for t in range(nt):
        st = t % NST
        copies_landed(NST - 1, NW)  # this token's copies (this thread's own elements) landed
        ml = mlbuf.index(ML0 + t).load(LML)
        ms = gl.sum(gl.where(mk == 0, ml, 0.0), axis=2)  # [GP, SP2]; masked splits: 0 with l = 0 (their weight
        ls = gl.sum(gl.where(mk == 1, ml, 0.0), axis=2)  # below counts nothing)
        ms = gl.where(gl.expand_dims(msp < n_splits, 0), ms, EMPTY_M_D)
        mx = gl.max(ms, axis=1)
        w = gl.exp2((ms - gl.expand_dims(mx, 1)) * LOG2E)
        w3 = gl.expand_dims(gl.convert_layout(w, gl.SliceLayout(2, L3)), 2)
        den = gl.expand_dims(gl.convert_layout(gl.sum(w * ls, axis=1), gl.SliceLayout(1, gl.SliceLayout(1, L3))), 1)
        for d0 in gl.static_range(0, HD, 32):
            po = obuf.index(st).slice(d0, 32, dim=2).load(L3)  # [GP, SP2, 32]
            o = gl.sum(w3 * po, axis=1) / den  # [GP, 32]
            gl.store(b.attn16 + (seg + t) * (C.HQ * HD) + d0 + out, o, mask=out_ok)
        _copy_partials(obuf, st, b, seg + t + NST, kvh, n_splits, t + NST < nt, C)
    copies_landed(0, NW)  # the stages' last copies (past the block: zero-filled) land before the buffer's reuse


@gluon.jit
def _copy_partials(obuf, stage, b, tok, kvh, n_splits, here, C: gl.constexpr):
    """cp.async of token ``tok``'s o partials [GP, SP2, HD] of KV group ``kvh`` (splits < n_splits, and nothing
    unless ``here``: zero-filled) into stage ``stage``, in the combine's layout, 32 columns at a time: one commit
    group."""
    HD: gl.constexpr = C.HD
    L3: gl.constexpr = combine_layout(C)
    g = gl.arange(0, C.GP, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    sp = gl.arange(0, C.SP2, gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    d = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
    row = gl.expand_dims(gl.expand_dims((tok * C.HQ + kvh * C.G + g) * b.splits, 1) + gl.expand_dims(sp, 0), 2)
    ok = gl.expand_dims(gl.expand_dims(g < C.G, 1) & gl.expand_dims((sp < n_splits) & here, 0), 2)  # [GP, SP2, 1]
    for d0 in gl.static_range(0, HD, 32):
        async_copy.async_copy_global_to_shared(obuf.index(stage).slice(d0, 32, dim=2), b.po + row * HD + d0 + d,
                                               mask=ok, cache_modifier=".cg")
    async_copy.commit_group()


@gluon.jit
def _copy(kvbuf, at, b, bt_row, layer, kvh, t, end, dk, C: gl.constexpr):
    """cp.async of the K and V rows of positions ``t`` [BT, 1] below ``end`` (the others zero-filled) into blocks
    ``at`` and ``at + 1`` of ``kvbuf`` (a stage): one commit group. Where C.FP8 the e4m3 rows land in the upper half
    of each block's bytes (``_raw``), which ``_dequantize`` widens into the block before its math."""
    page = gl.load(bt_row + t // C.PS, mask=t < end, other=0)
    row = ((layer * b.num_pages + page) * C.HKV + kvh) * C.PS + t % C.PS
    addr = row.to(gl.int64) * C.HD + dk  # past 2^31 elements (the 8B's 32 layers x 4096 pages)
    m = t < end  # [BT, 1]: broadcast over a row, whose 16-byte vectors stay whole
    if C.FP8:
        raw = _raw(kvbuf, C)
        async_copy.async_copy_global_to_shared(raw.index(2 * at + 1), b.kc + addr, mask=m, cache_modifier=".cg")
        async_copy.async_copy_global_to_shared(raw.index(2 * at + 3), b.vc + addr, mask=m, cache_modifier=".cg")
    else:
        async_copy.async_copy_global_to_shared(kvbuf.index(at), b.kc + addr, mask=m, cache_modifier=".cg")
        async_copy.async_copy_global_to_shared(kvbuf.index(at + 1), b.vc + addr, mask=m, cache_modifier=".cg")
    async_copy.commit_group()


@gluon.jit
def _raw(kvbuf, C: gl.constexpr):
    """The staging blocks' bytes as e4m3 [2 x blocks, BT, HD], unswizzled: block i's lower half is index 2 i, its
    upper half 2 i + 1 (an fp8 block's rows take half a bf16 block's bytes)."""
    n: gl.constexpr = kvbuf.type.shape[0]
    return kvbuf._reinterpret(gl.float8e4nv, [2 * n, C.QBT, C.HD],
                              gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))


@gluon.jit
def _dequantize(kvbuf, kb, b, bt_row, layer, kvh, t0, hi, C: gl.constexpr):
    """Where C.FP8: stage ``kb``'s e4m3 K and V rows (landed, and visible to every thread) widened into the stage's
    bf16 blocks, each row times its bf16 scale (kv/fp8.py's dequantize, rounded to bf16 for the tensor cores); rows
    at or past ``hi`` were zero-filled and get scale 0. Every thread reads its share into registers, the partition
    waits, then writes the bf16 rows over the same bytes; a second barrier makes them visible."""
    CP: gl.constexpr = copy_layout(C)
    raw = _raw(kvbuf, C)
    k8 = raw.index(2 * kb + 1).load(CP)
    v8 = raw.index(2 * kb + 3).load(CP)
    t = t0 + gl.arange(0, C.QBT, gl.SliceLayout(1, CP))
    page = gl.load(bt_row + t // C.PS, mask=t < hi, other=0)
    row = ((layer * b.num_pages + page) * C.HKV + kvh) * C.PS + t % C.PS
    # .cg: past L1 (not coherent across SMs), as the rows' copies: rows this step wrote came after the wait
    ks = gl.expand_dims(gl.load(b.ksc + row.to(gl.int64), mask=t < hi, other=0.0, cache_modifier=".cg"), 1)
    vs = gl.expand_dims(gl.load(b.vsc + row.to(gl.int64), mask=t < hi, other=0.0, cache_modifier=".cg"), 1)
    k = (k8.to(gl.float32) * ks.to(gl.float32)).to(gl.bfloat16)
    v = (v8.to(gl.float32) * vs.to(gl.float32)).to(gl.bfloat16)
    partition_barrier(C.NW)  # every thread holds its rows: the bf16 rows may overwrite the e4m3 bytes
    kvbuf.index(kb).store(k)
    kvbuf.index(kb + 1).store(v)
    partition_barrier(C.NW)


@gluon.jit
def _stage_q(qs, kvh, seg, nt, b, C: gl.constexpr):
    """q [R, HD] to shared memory as bf16, pre-scaled: row r is token r // GP's head kvh * G + r % GP (padding
    rows 0), 16 rows at a time (a few registers a thread). The partial's first barrier makes it visible."""
    HD: gl.constexpr = C.HD
    QL: gl.constexpr = gl.BlockedLayout([1, 4], [32 // min(32, HD // 4), min(32, HD // 4)], [C.NW, 1], [1, 0])
    d = gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, QL)), 0)
    for r0 in gl.static_range(0, rows(C), 16):
        r = gl.expand_dims(r0 + gl.arange(0, 16, gl.SliceLayout(1, QL)), 1)  # [16, 1]
        q = gl.load(b.q + ((seg + r // C.GP) * C.HQ + kvh * C.G + r % C.GP) * HD + d,
                    mask=(r // C.GP < nt) & (r % C.GP < C.G), other=0.0, cache_modifier=".cg")
        qs.slice(r0, 16).store((q * b.qscale).to(gl.bfloat16))


@gluon.jit
def _partial(layer, kvh, seg, nt, split, p0, lo, hi, kvbuf, bt_row, tk, dk, b, C: gl.constexpr):
    """The split's partial of every query row, blocks 0 and 1 in flight: the online softmax over its K/V blocks,
    (o, m, l) stored per token and head to the partials' scratch."""
    G: gl.constexpr = C.G
    GP: gl.constexpr = C.GP
    HD: gl.constexpr = C.HD
    BT: gl.constexpr = C.QBT
    R: gl.constexpr = rows(C)
    MMA: gl.constexpr = mma_layout(C)
    QA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    KB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    qs = kvbuf._reinterpret(gl.bfloat16, [R, HD], stage_layout(C))  # _stage_q's (the buffer's first rows)
    r = gl.arange(0, R, ROW)
    tpos = gl.expand_dims(p0 + r // GP, 1)  # [R, 1] each row's token position
    live = gl.expand_dims(r // GP < nt, 1)
    KS: gl.constexpr = min(BT, 2048 // HD)  # 32 keys (head_dim 64), 16 (128)
    c = gl.expand_dims(gl.arange(0, KS, COL), 0)  # [1, KS]
    m_i = gl.full([R], EMPTY_M_D, gl.float32, ROW)
    l_i = gl.zeros([R], gl.float32, ROW)
    o = gl.zeros([R, HD], gl.float32, MMA)
    QU: gl.constexpr = (R + BT - 1) // BT
    for t0 in range(lo, hi, BT):
        kb = QU + 2 * (((t0 - lo) // BT) % 2)  # the stage's K block; V at kb + 1
        copies_landed(1, C.NW)  # this block's copies (this thread's) landed; the next block's may fly
        partition_barrier(C.NW)  # ... and every thread's (and q's stores, before the first block)
        if C.FP8:
            _dequantize(kvbuf, kb, b, bt_row, layer, kvh, t0, hi, C)
        # the block in sub-blocks of KS keys, S over HD in chunks of 32: every operand at 16 registers a thread or
        # fewer but V's [KS, HD] (the 8B's: 32), so the kernel's other paths keep theirs
        for k0 in gl.static_range(0, BT, KS):
            kst = kvbuf.index(kb).slice(k0, KS)  # K [KS, HD]
            sc = gl.zeros([R, KS], gl.float32, MMA)
            for d0 in gl.static_range(0, HD, 32):
                sc = mma_v2(qs.slice(d0, 32, dim=1).load(QA), kst.slice(d0, 32, dim=1).permute((1, 0)).load(KB), sc)
            kp = t0 + k0 + c
            valid = live & (kp < hi) & (kp <= tpos)
            sc = gl.where(valid, sc, EMPTY_M_D)
            m_new = gl.maximum(m_i, gl.max(sc, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.where(valid, gl.exp2(sc - gl.expand_dims(m_new, 1)), 0.0)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            pa = gl.convert_layout(p.to(gl.bfloat16), QA)
            v = kvbuf.index(kb + 1).slice(k0, KS).load(KB)  # V [KS, HD]
            o = mma_v2(pa, v, o * gl.expand_dims(alpha, 1))
            m_i = m_new
        partition_barrier(C.NW)  # every thread read the stage: block + 2 may overwrite it
        _copy(kvbuf, kb, b, bt_row, layer, kvh, t0 + 2 * BT + tk, hi, dk, C)
    copies_landed(0, C.NW)  # the last copies (past the split: zero-filled) land before the buffer is reused
    # partials: token t's row of part_o / part_ml, head kvh * G + j, this split
    dd = gl.expand_dims(gl.arange(0, HD, COL), 0)
    tok = seg + r // GP
    base = (tok * C.HQ + kvh * G + r % GP) * b.splits + split  # [R]
    ok = (r // GP < nt) & (r % GP < G)
    gl.store(b.po + gl.expand_dims(base * HD, 1) + dd, o, mask=gl.expand_dims(ok, 1))
    gl.store(b.pml + base * 2, gl.where(l_i > 0.0, m_i * LN2, EMPTY_M_D), mask=ok)
    gl.store(b.pml + base * 2 + 1, l_i, mask=ok)
