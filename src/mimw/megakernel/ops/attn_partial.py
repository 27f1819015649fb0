"""ATTN_PARTIAL: attention of one segment's query tokens (or a query block's: ``tokens`` one-token segments of one
sequence, program.StepShape.attn_blocks) over one split of its context, for the G query heads that share one KV
head; the last split of the segment and group to draw its ticket combines every split's partial, every token's.

    ctx = seg_ctx[last segment];  [lo, hi) = state.split_range(ctx, split, n_splits, query tokens)   (possibly
    empty; the last split holds the step's new positions)
    for every query token t of the segment (position p_t) and query head h of the group (h = kv_head*G + j):
        s_j   = (q[t, h] . K[j]) * hd^-0.5        for j in [lo, hi), masked out where j > p_t (causal)
        m     = max_j s_j                       (EMPTY_M when no j survives)
        l     = sum_j exp(s_j - m)
        o     = sum_j exp(s_j - m) V[j]         [hd]
solve writes part_o[t, h, split, :] = o, part_ml[t, h, split] = (m, l); an empty split (or one fully masked for
token t) stores (EMPTY_M, 0) and o = 0. Reads q[t, h] for the segment's tokens and the group's heads, and K/V of
layer ``layer``, kv head ``kv_head`` at positions [lo, hi) through the segment's block table (positions of this
step were stored by ATTN_IN).
finish (the combining split) writes attn[t, h*hd:(h+1)*hd] for the group's heads: over splits i < n_splits,
    M = max_i m_i;  w_i = exp(m_i - M)  (an empty split has w_i = 0);  out = sum_i w_i o_i / sum_i w_i l_i
Tiles: none in the words; a one-token step's past K/V comes through the ring all the same (device/kv_stream.py).

Device (``compute``): a query block of more than one token runs ``_compute_block`` (attn_query_block.py's noinline
parts around the wait and the ticket: its tokens x the group's heads on mma.sync); every other split runs
``_compute_one``: split-KV decode attention over the paged cache, all query heads of a KV group in one pass.
Each [BT, HD] block of K and V is read once and used for the scores of all GP heads (GP = G rounded up to a power
of two; padding heads have q = 0 and are never stored). Each warp owns BT / NW consecutive positions of every block
and keeps its own online-softmax state, so every reduction inside the loop stays within a warp; the warps' states
merge once at the end, through the staging buffer (free during attention) with one barrier where it holds them
(``_merge_smem``), else through Triton's reductions over the warp axis. Only the newest row (position ``pos``,
written by ATTN_IN in this step) depends on the step; the split holding it (the last) reads it after the wait, with
q, and adds it to warp 0's state as a block one position wide (``_start``).
Every split whose query is one token (a one-token step's; in a multi-token step every one-token attention group's: a
decode batch's segments, a mixed step's single tokens, each over its own segment's context and block table row): the
loader has streamed the split's past positions into ring slots (device/ring.py, device/kv_stream.py), KVS positions a
slot, before and while the instruction waits; compute consumes them in order with the ring's running tile counter,
masking the positions outside the split in its first and last slots. Where a slot holds 16 positions a warp or more
(``C.ATTN_MMA``, derived by plan.py: at four compute warps every fp8 slot, and bf16's at head_dim 64) the walk runs on
the tensor cores, slot by slot, every warp its own online-softmax state over its rows of the slot, merged with the
newest row's once a split (``_partial_ring_mma``: ops/attn_ring_mma.py); else (bf16 at head_dim 128: 32 positions a
slot, 8 a warp) on the CUDA cores, block by block, each lane of a warp keeping its own online-softmax state over its
positions (``_partial_ring``, ``layouts.attention_lanes``; merged once a split). A one-token split is bound by the
compute warps' work a position, not by its bytes: mma.sync's products take most of that work off the CUDA cores. A
multi-token step's one-token segment that continues rows other segments write in this step (a verify block's tokens
past a query block: ``first``, state.seg_new, before its position) has only its past before ``first`` in the ring; the
rest is read from the cache after the wait, one round trip a block (``_late``; none in a decode batch). Scores are kept
in the base-2 domain (q pre-scaled by head_dim^-0.5 * log2(e)) so the online softmax uses exp2; partials are stored in
the natural-log domain of the state.py contract (m * ln 2). Rows read from global memory go through L2 (.cg): the
newest row was written by another CTA in this step. The last split to draw the ticket combines every split's partial in
one round of independent loads.

An fp8 cache (``C.FP8``: e4m3 rows, a bf16 scale per (token, KV head) row, kv/pages.py): the scales arrive beside each
ring slot and scale each position's score and V weight (the same values as dequantising first, up to fp32 rounding;
attn_ring_mma's module doc gives the tensor cores' form); rows read from the cache (the newest, ``_late``'s) are
dequantised in registers as kv/fp8.py's ``dequantize`` computes them (``float(q) * float(scale)``, exact in fp32). A
one-token step's blocks hold twice bf16's positions (``plan.attn_block``: 8 KB of K, 16 KB of K and V, one ring slot);
a multi-token step's keep bf16's (``_late``'s blocks in registers), its slots fp8's (walked on the tensor cores).
Element offsets into the pools are int64: the 8B's pools pass 2^31 elements at 128k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...models.spec import ModelSpec
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..device import kv_stream, layouts
from ..device.context import PACK_SHIFT, W_A, W_B, W_C, W_D, W_E, W_LAYER, Step
from ..device.kv_stream import split_range as _split_range
from ..device.ring import consumer_release
from ..device.sync import counter_wait, globaltimer, ticket_is_last
from ..isa import NO_COUNTER, Instruction, Op, Word
from ..state import EMPTY_M, split_range
from . import attn_query_block, attn_ring_mma
from .common import OpContext

OP = Op.ATTN_PARTIAL


@dataclass(frozen=True)
class AttnPartial(Instruction):
    OP: ClassVar[Op] = Op.ATTN_PARTIAL
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "kv_head": Word.A, "seg": Word.B, "split": Word.C,
                                         "n_splits": Word.D, "ticket": Word.E}
    PACKED: ClassVar[dict[str, tuple[Word, int]]] = {"tokens": (Word.B, 1)}
    layer: int = 0
    kv_head: int = 0
    seg: int = 0
    tokens: int = 1  # segments seg .. seg + tokens - 1 as one query block (StepShape.attn_blocks: one-token
    # segments of one sequence at consecutive positions); 1: segment seg alone
    split: int = 0
    n_splits: int = 1
    ticket: int = NO_COUNTER  # the counter the splits draw tickets from (a lone split: none)

    @property
    def has_finisher(self) -> bool:
        return True  # the last split combines (a lone split at once)

    @property
    def ticket_count(self) -> int:
        return self.n_splits


def kv_bytes(spec: ModelSpec, ins: AttnPartial, context: int, seg_len: int, row_bytes: int = 0) -> int:
    """The K/V bytes one split reads at ``context`` (the scheduler's cost model); ``row_bytes``: one cached K row's
    bytes, scale included (0: bf16)."""
    return math.ceil((context + seg_len) / ins.n_splits) * (row_bytes or spec.head_dim * 2) * 2


def query(ctx: OpContext, ins: AttnPartial) -> tuple[slice, int]:
    """The instruction's query tokens and the context after them: a segment's, or a query block's (its segments
    continue one sequence, the last one's context is the block's); raises ValueError where the step state's
    segments of a block do not (the GPU reads them as one sequence)."""
    toks = ctx.program.shape.query_tokens(ins.seg, ins.tokens)
    last = ins.seg + ins.tokens - 1
    if ins.tokens > 1:
        st = ctx.state
        p0 = int(st.positions[toks.start])
        if (st.positions[toks].tolist() != list(range(p0, p0 + ins.tokens))
                or not bool((st.block_tables[ins.seg: last + 1] == st.block_tables[ins.seg]).all())):
            raise ValueError(f"{ins}: segments {ins.seg}..{last} are not one sequence's consecutive positions")
    return toks, int(ctx.state.seg_ctx[last])


def solve(ctx: OpContext, ins: AttnPartial) -> None:
    spec, sc = ctx.spec, ctx.scratch
    g, hd = spec.group_size, spec.head_dim
    heads = slice(ins.kv_head * g, (ins.kv_head + 1) * g)
    toks, context = query(ctx, ins)
    lo, hi = split_range(context, ins.split, ins.n_splits, toks.stop - toks.start)
    if lo == hi:
        sc.part_o[toks, heads, ins.split] = 0.0
        sc.part_ml[toks, heads, ins.split, 0] = EMPTY_M
        sc.part_ml[toks, heads, ins.split, 1] = 0.0
        return
    q = sc.q[toks, heads]  # [T, G, hd]
    ps = ctx.cache.layout.page_size
    pos = torch.arange(lo, hi)  # [S]
    pages, rows = ctx.state.block_tables[ins.seg].long()[pos // ps], pos % ps
    k = ctx.cache.load("k", ins.layer, pages, rows, head=ins.kv_head).float()  # [S, hd], dequantised for fp8
    v = ctx.cache.load("v", ins.layer, pages, rows, head=ins.kv_head).float()
    s = (q @ k.t()) * hd ** -0.5  # [T, G, S]
    q_pos = ctx.state.positions[toks].long()  # [T]
    if hi - 1 > int(q_pos.min()):  # some key lies in some query token's future
        s = s.masked_fill((pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    m = s.amax(-1)  # [T, G]; -inf where the whole split is in token t's future
    empty = torch.isneginf(m)
    p = torch.exp(s - m.masked_fill(empty, 0.0)[..., None])  # masked -> exp(-inf) = 0
    sc.part_o[toks, heads, ins.split] = p @ v
    sc.part_ml[toks, heads, ins.split, 0] = m.masked_fill(empty, EMPTY_M)
    sc.part_ml[toks, heads, ins.split, 1] = p.sum(-1)


def combine(ctx: OpContext, kv_head: int, toks: slice, n_splits: int) -> torch.Tensor:
    """The group's attention output [T, G*hd] for the T tokens ``toks``, from splits [0, n_splits)' partials."""
    spec, sc = ctx.spec, ctx.scratch
    g = spec.group_size
    heads = slice(kv_head * g, (kv_head + 1) * g)
    o = sc.part_o[toks, heads, :n_splits]  # [T, G, n, hd]
    m, l = sc.part_ml[toks, heads, :n_splits].unbind(-1)  # [T, G, n] each
    w = torch.exp(m - m.amax(-1, keepdim=True))  # [T, G, n]
    out = (w[..., None] * o).sum(-2) / (w * l).sum(-1)[..., None]  # [T, G, hd]
    return out.reshape(out.shape[0], g * spec.head_dim)


def finish(ctx: OpContext, ins: AttnPartial) -> None:
    gh = ctx.spec.group_size * ctx.spec.head_dim
    toks = ctx.program.shape.query_tokens(ins.seg, ins.tokens)
    ctx.scratch.attn[toks, ins.kv_head * gh: (ins.kv_head + 1) * gh] = combine(ctx, ins.kv_head, toks, ins.n_splits)


# --- device ---------------------------------------------------------------------------------------------------

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
EMPTY_M_D: gl.constexpr = gl.constexpr(EMPTY_M)


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, wait, target, sig):
    """One split on the GPU: a query block's (C.QT > 1, the instruction's block past one token:
    attn_query_block.py), or one segment's (``_compute_one``). Returns (the counter it signals: ``sig`` for the
    combining split, else -1; the time its wait was met, 0 untraced; the ring's running tile counter past the
    split's slots: a one-token split's only)."""
    if C.QT > 1:
        nt = (ins.field(W_B) >> PACK_SHIFT) + 1
        if nt > 1:
            sig, t_ready = _compute_block(ins, nt, C, s, b, sm, wait, target, sig)
        else:
            sig, t_ready, it = _compute_one(ins, C, s, b, sm, it, wait, target, sig)
    else:
        sig, t_ready, it = _compute_one(ins, C, s, b, sm, it, wait, target, sig)
    return sig, t_ready, it


@gluon.jit
def _compute_block(ins, nt, C: gl.constexpr, s, b, sm, wait, target, sig):
    """One split of a query block of ``nt`` tokens: its noinline parts (attn_query_block.py) around the dependency
    wait and the ticket, which stay here, in the kernel's own code, where Triton makes their barriers the
    partition's (a noinline function's would be the CTA's: device/sync.py)."""
    layer = ins.field(W_LAYER)
    kvh = ins.field(W_A)
    seg = ins.field(W_B) & ((1 << PACK_SHIFT) - 1)
    split = ins.field(W_C)
    n_splits = ins.field(W_D)
    blk = attn_query_block.Block(s, b, sm)
    attn_query_block.request_block(layer, kvh, seg, nt, split, n_splits, blk, C)
    if wait >= 0:
        counter_wait(s.cnt, wait, target)
    t_ready = 0
    if C.TRACE:
        t_ready = globaltimer()
    attn_query_block.compute_block(layer, kvh, seg, nt, split, n_splits, blk, C)
    if ticket_is_last(s.cnt, ins.field(W_E), n_splits, s.epoch):  # the last split combines every token
        attn_query_block.combine_block(kvh, seg, nt, n_splits, blk, C)
    else:
        sig = -1
    return sig, t_ready


@gluon.jit
def _compute_one(ins, C: gl.constexpr, s, b, sm, it, wait, target, sig):
    """One split of one segment: the dependency wait (``wait`` < 0: none), the partial (its past K/V from the ring,
    slots from tile ``it`` on; a multi-token step's segment's own context, block table row and first written
    position), and the ticket's combine."""
    layer = ins.field(W_LAYER)
    kvh = ins.field(W_A)
    seg = ins.field(W_B) & ((1 << PACK_SHIFT) - 1)
    split = ins.field(W_C)
    n_splits = ins.field(W_D)
    q_ptr = b.q
    po_ptr = b.po
    pml_ptr = b.pml
    attn_ptr = b.attn
    first = s.pos  # the first position this step writes in the sequence (one token: its own)
    if C.M > 1:  # one-token segments: segment seg is token seg, its position, context, page and first written
        # position (a verify block's first, where the segment continues it) read from the step
        pos = gl.load(s.poss + seg)
        first = gl.load(s.news + seg)
        s = Step(s.cnt, s.ncnt, s.rdy, s.bt, s.maxp, s.epoch, pos, gl.load(s.ctxs + seg),
                 gl.load(s.bt + seg * s.maxp + pos // C.PS), s.emb_row, s.toks, s.poss, s.ctxs, s.news)
        q_ptr = b.q + seg * (C.HQ * C.HD)
        po_ptr = b.po + seg * (C.HQ * C.HD) * b.splits
        pml_ptr = b.pml + seg * (C.HQ * 2) * b.splits
        attn_ptr = b.attn16 + seg * (C.HQ * C.HD)  # bf16: as O_PROJ stages it (device/matvec_mt.py)
        if C.KVS == 0:  # over an fp8 cache: the first block requested before the wait (``_prefetch``)
            k0, v0, ks0, vs0 = _prefetch(layer, kvh, seg, split, n_splits, first, s, b, C)
    if wait >= 0:
        counter_wait(s.cnt, wait, target)
    t_ready = 0
    if C.TRACE:
        t_ready = globaltimer()
    if C.KVS == 0:
        _partial(layer, kvh, seg, split, n_splits, first, k0, v0, ks0, vs0, s, b, sm, q_ptr, po_ptr, pml_ptr, C)
    else:
        if C.ATTN_MMA:
            it = _partial_ring_mma(layer, kvh, seg, split, n_splits, first, s, b, sm, it, q_ptr, po_ptr, pml_ptr, C)
        else:
            it = _partial_ring(layer, kvh, seg, split, n_splits, first, s, b, sm, it, q_ptr, po_ptr, pml_ptr, C)
    if ticket_is_last(s.cnt, ins.field(W_E), n_splits, s.epoch):  # the last split combines and signals
        _reduce(kvh, n_splits, b, po_ptr, pml_ptr, attn_ptr, C)
    else:
        sig = -1
    return sig, t_ready, it


@gluon.jit
def _rows(bt_ptr, seg, maxp, t, hi, layer, num_pages, kvh, C: gl.constexpr):
    """Cache row index of positions t (masked past hi) of one KV head: one block-table gather."""
    page = gl.load(bt_ptr + seg * maxp + t // C.PS, mask=t < hi, other=0)
    return ((layer * num_pages + page) * C.HKV + kvh) * C.PS + t % C.PS


@gluon.jit
def _kv(b, row, m, d3, C: gl.constexpr):
    """K and V rows ``row`` [NW, BTW] (mask m) as [NW, BTW, HD] in the cache's element type, and (C.FP8) their
    scales [NW, BTW] (else placeholders): all requested before any is used. ``row`` is also the scales' index."""
    addr = gl.expand_dims(row, 2).to(gl.int64) * C.HD + d3  # past 2^31 elements at long contexts (8B at 128k)
    m3 = gl.expand_dims(m, 2)
    k = gl.load(b.kc + addr, mask=m3, other=0.0, cache_modifier=".cg")
    v = gl.load(b.vc + addr, mask=m3, other=0.0, cache_modifier=".cg")
    ks = row
    vs = row
    if C.FP8:
        ks = gl.load(b.ksc + row, mask=m, other=0.0, cache_modifier=".cg")
        vs = gl.load(b.vsc + row, mask=m, other=0.0, cache_modifier=".cg")
    return k, v, ks, vs


@gluon.jit
def _deq(x, scale, C: gl.constexpr):
    """Rows [NW, BTW, HD] as fp32: bf16 widened, or (C.FP8) e4m3 times its row's bf16 scale [NW, BTW], exact in fp32
    as kv/fp8.py's dequantize."""
    out = x.to(gl.float32)
    if C.FP8:
        out = out * gl.expand_dims(scale.to(gl.float32), 2)
    return out


@gluon.jit
def _positions(BT: gl.constexpr, NW: gl.constexpr, L2: gl.constexpr):
    """[NW, BTW] offsets w * BTW + j of a block's positions: warp w owns BTW consecutive positions."""
    BTW: gl.constexpr = BT // NW
    w = gl.arange(0, NW, gl.SliceLayout(1, L2))
    j = gl.arange(0, BTW, gl.SliceLayout(0, L2))
    return gl.expand_dims(w, 1) * BTW + gl.expand_dims(j, 0)


@gluon.jit
def _prefetch(layer, kvh, seg, split, n_splits, first, s, b, C: gl.constexpr):
    """A multi-token step's split over an fp8 cache (``_partial``), before the dependency wait: the first block's
    K/V (past positions only; ``pos``, which ATTN_IN writes in this step, is never in a block) does not depend on the
    step, so its round trip overlaps the wait. A multi-token step's segment may continue rows of its sequence that
    other segments write in this step (a verify block as one-token segments): positions from ``first`` on are left
    for after the wait (``_partial``)."""
    KV3: gl.constexpr = gl.SliceLayout(1, layouts.attention(C))
    lo, hi, hp = _split_range(split, n_splits, s.ctx)
    t = lo + _positions(C.BT, C.NW, gl.SliceLayout(2, KV3))
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, C.HD, gl.SliceLayout(0, gl.SliceLayout(1, KV3))), 0), 1)
    row = _rows(s.bt, seg, s.maxp, t, hp, layer, b.num_pages, kvh, C)
    if C.M > 1:
        return _kv(b, row, t < gl.minimum(hp, first), d3, C)
    return _kv(b, row, t < hp, d3, C)


@gluon.jit
def _block(q4, k, v, valid, m_i, l_i, o, Q3: gl.constexpr):
    """One block of the online softmax, per warp, over fp32 K/V [NW, BTW, HD]: scores [NW, GP, BTW] (invalid
    positions masked), then the running max m_i, denominator l_i [NW, GP] and output o [NW, GP, HD] are rescaled
    and updated."""
    sc = gl.sum(q4 * gl.expand_dims(k, 1), axis=3)
    sc = gl.where(valid, sc, EMPTY_M_D)
    m_new = gl.maximum(m_i, gl.max(sc, axis=2))
    alpha = gl.exp2(m_i - m_new)
    p = gl.where(valid, gl.exp2(sc - gl.expand_dims(m_new, 2)), 0.0)
    l_i = l_i * alpha + gl.sum(p, axis=2)
    pv = gl.sum(gl.expand_dims(p, 3) * gl.expand_dims(v, 1), axis=2)
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(2, Q3)), 2) + pv
    return m_new, l_i, o


@gluon.jit
def _start(layer, kvh, lo, hi, s, b, q_ptr, C: gl.constexpr):
    """A split's queries and its online-softmax state before its past blocks: q [NW, GP, HD] (pre-scaled: every
    warp holds the G heads of the group; padding heads load 0 and are never stored), and (m_i, l_i [NW, GP], o
    [NW, GP, HD]) empty, or where the split holds position ``pos`` (the last split, [lo, hi)) holding that newest
    row, read from the cache, where ATTN_IN stored it before it signalled, in q's round trip: a block one position
    wide (K and V [1, 1, HD], scores [NW, GP, 1]), warp 0's."""
    G: gl.constexpr = C.G
    GP: gl.constexpr = C.GP
    HD: gl.constexpr = C.HD
    NW: gl.constexpr = C.NW
    L4: gl.constexpr = layouts.attention(C)
    KV3: gl.constexpr = gl.SliceLayout(1, L4)
    Q3: gl.constexpr = gl.SliceLayout(2, L4)
    S3: gl.constexpr = gl.SliceLayout(3, L4)
    pos = s.pos
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, KV3))), 0), 1)
    g1 = gl.arange(0, GP, gl.SliceLayout(0, gl.SliceLayout(2, Q3)))
    dq = gl.expand_dims(gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, Q3))), 0), 1)
    g3 = gl.expand_dims(gl.expand_dims(g1, 0), 2) + dq * 0  # [1, GP, HD] head index
    q = gl.load(q_ptr + (kvh * G + g3) * HD + dq, mask=g3 < G, other=0.0, cache_modifier=".cg") * b.qscale
    q4 = gl.expand_dims(q, 2)
    holds = (lo <= pos) & (pos < hi)
    here = (d3 * 0 + holds.to(gl.int32)) != 0
    at_row = ((layer * b.num_pages + s.tok_page) * C.HKV + kvh) * C.PS + pos % C.PS
    at = at_row.to(gl.int64) * HD + d3
    k_new = gl.load(b.kc + at, mask=here, other=0.0, cache_modifier=".cg").to(gl.float32)
    v_new = gl.load(b.vc + at, mask=here, other=0.0, cache_modifier=".cg").to(gl.float32)
    if C.FP8:  # the row's scale, broadcast along HD
        at_s = at_row + d3 * 0
        k_new = k_new * gl.load(b.ksc + at_s, mask=here, other=0.0, cache_modifier=".cg").to(gl.float32)
        v_new = v_new * gl.load(b.vsc + at_s, mask=here, other=0.0, cache_modifier=".cg").to(gl.float32)
    m_i = gl.full([NW, GP], EMPTY_M_D, gl.float32, gl.SliceLayout(2, S3))
    l_i = gl.zeros([NW, GP], gl.float32, gl.SliceLayout(2, S3))
    o = gl.zeros([NW, GP, HD], gl.float32, Q3)
    if holds:
        w0 = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, gl.SliceLayout(2, S3))), 1), 2)
        m_i, l_i, o = _block(q4, k_new, v_new, w0 == 0, m_i, l_i, o, Q3)
    return q, m_i, l_i, o


@gluon.jit
def _ring_block(q5, k, v, ks, vs, valid, ok, m, l, o, MASKED: gl.constexpr, C: gl.constexpr):
    """One block read from a ring slot, in the lanes' layout (``layouts.attention_lanes``): K and V [NW, PT, PL,
    HD] in the cache's element type against q5 [NW, GP, 1, 1, HD]; each lane keeps its own online-softmax state over
    its positions (m, l [NW, GP, PL], o [NW, GP, PL, HD]: the registers ``_block``'s replicated state takes), so
    the block's only cross-lane step is the dot products' sum over head_dim. An fp8 cache's scales ([NW, 1, PT, PL],
    one a position) scale the scores and the probabilities that weight V rather than every element (the same values
    as dequantising first up to fp32 rounding, half the per-element work). ``MASKED``: positions outside ``valid``
    [NW, 1, PT, PL] get no weight and their V rows (``ok`` [NW, PT, PL, 1]) are zeroed, for stale bytes may be NaN;
    a block wholly inside the split skips the selects."""
    O4: gl.constexpr = gl.SliceLayout(2, layouts.attention_lanes(C))
    sc = gl.sum(q5 * gl.expand_dims(k.to(gl.float32), 1), axis=4)  # [NW, GP, PT, PL]
    if C.FP8:
        sc = sc * ks.to(gl.float32)
    if MASKED:
        sc = gl.where(valid, sc, EMPTY_M_D)
    m_new = gl.maximum(m, gl.max(sc, axis=2))  # within each thread: its positions of its lane
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(sc - gl.expand_dims(m_new, 2))
    vf = v.to(gl.float32)
    if MASKED:
        p = gl.where(valid, p, 0.0)
        vf = gl.where(ok, vf, 0.0)
    l = l * alpha + gl.sum(p, axis=2)
    if C.FP8:
        p = p * vs.to(gl.float32)
    pv = gl.sum(gl.expand_dims(p, 4) * gl.expand_dims(vf, 1), axis=2)  # [NW, GP, PL, HD]
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(3, O4)), 3) + pv
    return m_new, l, o


@gluon.jit
def _lane_positions(NW: gl.constexpr, PT: gl.constexpr, PL: gl.constexpr, L3: gl.constexpr):
    """[NW, PT, PL] offsets of a block's positions in the lanes' layout: w * PT * PL + i * PL + j."""
    w = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, gl.SliceLayout(2, L3))), 1), 2)
    i = gl.expand_dims(gl.expand_dims(gl.arange(0, PT, gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0), 2)
    j = gl.expand_dims(gl.expand_dims(gl.arange(0, PL, gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
    return (w * PT + i) * PL + j


@gluon.jit
def _ring_slots(split, n_splits, first, s, C: gl.constexpr):
    """(lo, hi, the end of the past positions the ring holds, a0, n): the split's ring slots (device/kv_stream.py);
    a multi-token step's one-token segment's past in the ring ends at ``first``, its first position this step
    writes (``_late`` reads the rest after the wait)."""
    if C.M > 1:
        lo, hi, hp, a0, n = kv_stream.segment_slots(split, n_splits, s.ctx, first, C.KVS, C.KVBOX)
    else:
        lo, hi, hp, a0, n = kv_stream.split_slots(split, n_splits, s.ctx, C.KVS, C.KVBOX)
    return lo, hi, hp, a0, n


@gluon.jit
def _late(q, m_i, l_i, o, layer, kvh, seg, split, n_splits, first, s, b, C: gl.constexpr):
    """A multi-token step's one-token segment after its wait: the split's past positions from ``first`` on (rows
    that other segments of its sequence stored in this step: a verify block's tokens before it; none in a decode
    batch), read from the cache block by block (``_kv``, one round trip a block) into the newest row's state
    (``_start``'s: every warp its BT / NW positions of a block)."""
    NW: gl.constexpr = C.NW
    BT: gl.constexpr = C.BT
    L4: gl.constexpr = layouts.attention(C)
    KV3: gl.constexpr = gl.SliceLayout(1, L4)
    Q3: gl.constexpr = gl.SliceLayout(2, L4)
    S3: gl.constexpr = gl.SliceLayout(3, L4)
    lo, hi, hp = _split_range(split, n_splits, s.ctx)
    tk = _positions(BT, NW, gl.SliceLayout(2, KV3))
    ts = gl.expand_dims(_positions(BT, NW, gl.SliceLayout(1, S3)), 1)  # [NW, 1, BTW]
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, C.HD, gl.SliceLayout(0, gl.SliceLayout(1, KV3))), 0), 1)
    q4 = gl.expand_dims(q, 2)
    for t0 in range(gl.maximum(lo, first), hp, BT):
        t = t0 + tk
        k, v, ks, vs = _kv(b, _rows(s.bt, seg, s.maxp, t, hp, layer, b.num_pages, kvh, C), t < hp, d3, C)
        m_i, l_i, o = _block(q4, _deq(k, ks, C), _deq(v, vs, C), t0 + ts < hp, m_i, l_i, o, Q3)
    return m_i, l_i, o


@gluon.jit
def _partial_ring(layer, kvh, seg, split, n_splits, first, s, b, sm, it, q_ptr, po_ptr, pml_ptr, C: gl.constexpr):
    """A one-token split after its wait, on the CUDA cores where its slots hold fewer than 16 positions a warp
    (not ``C.ATTN_MMA``): the split's past K/V from the ring, slot by slot as the loader streamed them
    (device/kv_stream.py: slot j holds positions [a0 + j KVS, +KVS) as KVS / BT blocks), each block read into registers
    in the lanes' layout and each slot handed back to the loader before its last block's math (``_ring_block``: every
    lane its own online-softmax state, lane 0's starting from the newest row's, ``_start``; positions outside [lo, hp)
    masked in the split's first and last blocks); then the lanes' states merged within each warp, and the warps' states
    merged and stored (``_store_split``). Returns the running tile counter past the split's slots."""
    NB: gl.constexpr = C.NB
    NW: gl.constexpr = C.NW
    BT: gl.constexpr = C.BT
    NSUB: gl.constexpr = C.KVS // BT
    L5: gl.constexpr = layouts.attention_lanes(C)
    PL: gl.constexpr = layouts.position_lanes(C)
    PT: gl.constexpr = BT // NW // PL
    gl.static_assert(PT * PL * NW == BT, "a block's positions must fill the lanes' layout")
    KV4: gl.constexpr = gl.SliceLayout(1, L5)  # [NW, PT, PL, HD] K/V block
    SC4: gl.constexpr = gl.SliceLayout(4, L5)  # [NW, GP, PT, PL] scores
    ST3: gl.constexpr = gl.SliceLayout(2, SC4)  # [NW, GP, PL] a lane's m, l
    O4: gl.constexpr = gl.SliceLayout(2, L5)  # [NW, GP, PL, HD] a lane's o
    lo, hi, hp, a0, n = _ring_slots(split, n_splits, first, s, C)
    tk = gl.expand_dims(_lane_positions(NW, PT, PL, gl.SliceLayout(3, KV4)), 3)  # [NW, PT, PL, 1]
    ts = gl.expand_dims(_lane_positions(NW, PT, PL, gl.SliceLayout(1, SC4)), 1)  # [NW, 1, PT, PL]
    q, m_i, l_i, o = _start(layer, kvh, lo, hi, s, b, q_ptr, C)
    if C.M > 1:
        m_i, l_i, o = _late(q, m_i, l_i, o, layer, kvh, seg, split, n_splits, first, s, b, C)
    q5 = gl.expand_dims(gl.expand_dims(gl.convert_layout(q, gl.SliceLayout(2, O4)), 2), 2)  # [NW, GP, 1, 1, HD]
    # the lanes' states: lane 0's starts from the newest row's state (warp 0 holds it), the others' empty
    lane3 = gl.expand_dims(gl.expand_dims(gl.arange(0, PL, gl.SliceLayout(0, gl.SliceLayout(1, ST3))), 0), 1)
    lane4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, PL, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, O4)))), 0), 1), 3)  # [1, 1, PL, 1]
    m_l = gl.where(lane3 == 0, gl.expand_dims(gl.convert_layout(m_i, gl.SliceLayout(2, ST3)), 2), EMPTY_M_D)
    l_l = gl.where(lane3 == 0, gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(2, ST3)), 2), 0.0)
    o_l = gl.where(lane4 == 0, gl.expand_dims(gl.convert_layout(o, gl.SliceLayout(2, O4)), 2), 0.0)
    for j in range(n):
        idx = it % NB
        mbarrier.wait(sm.ready.index(idx), (it // NB) & 1)
        rows = kv_stream.slot_rows(sm.bufs, idx, PL, C)
        for u in gl.static_range(NSUB):
            k = rows.slice(u * NW, NW).load(KV4)
            v = rows.slice((NSUB + u) * NW, NW).load(KV4)
            ks = k
            vs = v
            if C.FP8:  # [NW, 1, PT, PL]: a scale a position, as the scores hold them
                scl = kv_stream.slot_scales(sm.sbuf, idx, PL, C)
                ks = gl.expand_dims(scl.slice(u * NW, NW).load(gl.SliceLayout(1, SC4)), 1)
                vs = gl.expand_dims(scl.slice((NSUB + u) * NW, NW).load(gl.SliceLayout(1, SC4)), 1)
            if u == NSUB - 1:  # every warp has read the slot (the barrier Gluon places before the arrive)
                consumer_release(sm.empty, idx)
            t0 = a0 + j * C.KVS + u * BT
            if (t0 >= lo) & (t0 + BT <= hp):  # a whole block of the split's past: no masks
                m_l, l_l, o_l = _ring_block(q5, k, v, ks, vs, ts, tk, m_l, l_l, o_l, False, C)
            else:  # the split's first or last block: positions outside [lo, hp) masked, their V rows zeroed
                m_l, l_l, o_l = _ring_block(q5, k, v, ks, vs, (t0 + ts >= lo) & (t0 + ts < hp),
                                            (t0 + tk >= lo) & (t0 + tk < hp), m_l, l_l, o_l, True, C)
        it += 1
    # the lanes' states merged within each warp, once a split
    m_w = gl.max(m_l, axis=2)  # [NW, GP]
    w_l = gl.exp2(m_l - gl.expand_dims(m_w, 2))
    l_w = gl.sum(l_l * w_l, axis=2)
    o_w = gl.sum(o_l * gl.expand_dims(gl.convert_layout(w_l, gl.SliceLayout(3, O4)), 3), axis=2)  # [NW, GP, HD]
    m = gl.convert_layout(m_w, m_i.type.layout)
    l = gl.convert_layout(l_w, l_i.type.layout)
    o = gl.convert_layout(o_w, o.type.layout)
    _store_split(m, l, o, kvh, split, b, sm, po_ptr, pml_ptr, C)
    return it


@gluon.jit
def _partial_ring_mma(layer, kvh, seg, split, n_splits, first, s, b, sm, it, q_ptr, po_ptr, pml_ptr,
                      C: gl.constexpr):
    """``_partial_ring`` on the tensor cores (attn_ring_mma.walk: every warp's state over its rows of the split's
    slots), merged with the newest row's state (``_start``: warp 0's) warp by warp, then the warps' states merged and
    stored (``_store_split``). Returns the running tile counter past the split's slots."""
    lo, hi, hp, a0, n = _ring_slots(split, n_splits, first, s, C)
    it, m_w, l_w, o_w = attn_ring_mma.walk(q_ptr, kvh, lo, hp, a0, n, b.qscale, sm, it, C)
    q, m_i, l_i, o = _start(layer, kvh, lo, hi, s, b, q_ptr, C)  # after the walk: its state is not live across it
    m = gl.maximum(m_i, m_w)
    a_i = gl.exp2(m_i - m)
    a_w = gl.exp2(m_w - m)
    Q3: gl.constexpr = o.type.layout
    o = (o * gl.expand_dims(gl.convert_layout(a_i, gl.SliceLayout(2, Q3)), 2)
         + o_w * gl.expand_dims(gl.convert_layout(a_w, gl.SliceLayout(2, Q3)), 2))
    l = l_i * a_i + l_w * a_w
    if C.M > 1:  # the rows this step wrote, once the walk's state has merged (fewer registers live)
        m, l, o = _late(q, m, l, o, layer, kvh, seg, split, n_splits, first, s, b, C)
    _store_split(m, l, o, kvh, split, b, sm, po_ptr, pml_ptr, C)
    return it


@gluon.jit
def _partial(layer, kvh, seg, split, n_splits, first, k, v, ks, vs, s, b, sm, q_ptr, po_ptr, pml_ptr,
             C: gl.constexpr):
    """A multi-token step's split over an fp8 cache (no ring: ``C.KVS`` = 0, plan.py) after its wait, given
    ``_prefetch``'s first block (k, v and their scales ks, vs where C.FP8): the newest row first (the split holding
    ``pos``: a one-position block, warp 0's), then block 0 (its rows from ``first`` on, which this step wrote,
    loaded now with their scales) and the split's later past blocks, each dequantised in registers (``_deq``); the
    warps' states merged; (o, m, l) stored to the partials' scratch."""
    NW: gl.constexpr = C.NW
    BT: gl.constexpr = C.BT
    HD: gl.constexpr = C.HD
    L4: gl.constexpr = layouts.attention(C)
    KV3: gl.constexpr = gl.SliceLayout(1, L4)  # [NW, BTW, HD] K/V block
    Q3: gl.constexpr = gl.SliceLayout(2, L4)  # [NW, GP, HD] queries / outputs (per warp)
    S3: gl.constexpr = gl.SliceLayout(3, L4)  # [NW, GP, BTW] scores
    lo, hi, hp = _split_range(split, n_splits, s.ctx)
    tk = _positions(BT, NW, gl.SliceLayout(2, KV3))
    ts = gl.expand_dims(_positions(BT, NW, gl.SliceLayout(1, S3)), 1)  # [NW, 1, BTW]
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, KV3))), 0), 1)
    q, m_i, l_i, o = _start(layer, kvh, lo, hi, s, b, q_ptr, C)
    q4 = gl.expand_dims(q, 2)
    if C.M > 1:  # block 0's rows this step wrote (a verify block's earlier tokens), read after the wait, with
        # their scales (C.FP8) where the prefetch left them 0
        if (first < hp) & (first < lo + BT):
            t = lo + tk
            late = (t >= first) & (t < hp)
            k2, v2, ks2, vs2 = _kv(b, _rows(s.bt, seg, s.maxp, t, hp, layer, b.num_pages, kvh, C), late, d3, C)
            late3 = gl.expand_dims(late, 2)
            k = gl.where(late3, k2, k)
            v = gl.where(late3, v2, v)
            if C.FP8:
                ks = gl.where(late, ks2, ks)
                vs = gl.where(late, vs2, vs)
    # block 0 (prefetched), then the rest of the split's past: one round trip a block
    m_i, l_i, o = _block(q4, _deq(k, ks, C), _deq(v, vs, C), lo + ts < hp, m_i, l_i, o, Q3)
    for t0 in range(lo + BT, hp, BT):
        t = t0 + tk
        row = _rows(s.bt, seg, s.maxp, t, hp, layer, b.num_pages, kvh, C)
        k, v, ks, vs = _kv(b, row, t < hp, d3, C)
        m_i, l_i, o = _block(q4, _deq(k, ks, C), _deq(v, vs, C), t0 + ts < hp, m_i, l_i, o, Q3)
    _store_split(m_i, l_i, o, kvh, split, b, sm, po_ptr, pml_ptr, C)


@gluon.jit
def _store_split(m_i, l_i, o, kvh, split, b, sm, po_ptr, pml_ptr, C: gl.constexpr):
    """The warps' online-softmax states merged (through the staging buffer where it holds them, else Triton's
    reductions over the warp axis) and the split's (o, m, l) stored to the partials' scratch."""
    G: gl.constexpr = C.G
    GP: gl.constexpr = C.GP
    HD: gl.constexpr = C.HD
    NW: gl.constexpr = C.NW
    Q3: gl.constexpr = gl.SliceLayout(2, layouts.attention(C))
    if C.SMEM_MERGE:
        mbuf = sm.hbuf
        if C.M > 1:  # the tokens' chunk buffer (device/matvec_mt.py), read as the one-token [KT_ROWS, TK] rows
            mbuf = sm.hbuf._reinterpret(gl.bfloat16, [C.KT_ROWS * C.MB, C.TK],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        mx, l_f, o_f = _merge_smem(m_i, l_i, o, mbuf, GP, HD, NW)
    else:  # the staging buffer is too small for the warps' states: Triton's reductions over the warp axis
        mx = gl.max(m_i, axis=0)  # [GP]
        wn = gl.exp2(m_i - gl.expand_dims(mx, 0))
        l_f = gl.sum(l_i * wn, axis=0)
        o_f = gl.sum(o * gl.expand_dims(gl.convert_layout(wn, gl.SliceLayout(2, Q3)), 2), axis=0)  # [GP, HD]
    O2: gl.constexpr = o_f.type.layout
    go = gl.arange(0, GP, gl.SliceLayout(1, O2))
    do = gl.arange(0, HD, gl.SliceLayout(0, O2))
    base = (kvh * G + go) * b.splits + split
    gl.store(po_ptr + gl.expand_dims(base * HD, 1) + gl.expand_dims(do, 0), o_f, mask=gl.expand_dims(go < G, 1))
    gs = gl.arange(0, GP, mx.type.layout)
    sbase = (kvh * G + gs) * b.splits + split
    gl.store(pml_ptr + sbase * 2, gl.where(l_f > 0.0, mx * LN2, EMPTY_M_D), mask=gs < G)
    gl.store(pml_ptr + sbase * 2 + 1, l_f, mask=gs < G)


@gluon.jit
def _merge_smem(m_i, l_i, o, mbuf, GP: gl.constexpr, HD: gl.constexpr, NW: gl.constexpr):
    """The NW warps' online-softmax states (m_i, l_i [NW, GP], o [NW, GP, HD]) merged through shared memory: each
    warp writes its state to ``mbuf`` (the staging buffer read as fp32: o, then m, then l), one partition barrier,
    and each thread reads the NW states of its own [GP, HD] elements (``MG``: the warp axis inside each thread,
    warps over the heads, lanes over HD) and merges them with no further exchange; returns (mx, l_f) [GP] and o_f
    [GP, HD]. Triton's reductions over the warp axis take 9 partition barriers. The barrier at the instruction's
    end orders these reads before the next instruction's staging writes. Reference: the warps are splits of the
    split (``combine``)."""
    gl.static_assert(mbuf.type.shape[0] * mbuf.type.shape[1] * 2 >= NW * GP * (HD + 2) * 4,
                     "the staging buffer must hold the warps' attention states")
    ROWS: gl.constexpr = mbuf.type.shape[0] * mbuf.type.shape[1] * 2 // (GP * HD * 4)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    so = mbuf._reinterpret(gl.float32, [ROWS, GP, HD], FLAT).slice(0, NW)
    smm = mbuf._reinterpret(gl.float32, [ROWS * HD, GP, 1], FLAT).slice(NW * HD, NW)  # [NW, GP, 1] past o
    sl = mbuf._reinterpret(gl.float32, [ROWS * HD, GP, 1], FLAT).slice(NW * HD + NW, NW)
    so.store(o)
    smm.store(gl.expand_dims(m_i, 2))
    sl.store(gl.expand_dims(l_i, 2))
    gl.thread_barrier()
    MG: gl.constexpr = gl.BlockedLayout([NW, 1, 2 if HD >= 64 else 1], [1, 1, 32], [1, NW, 1], [2, 1, 0])
    m = gl.sum(smm.load(MG), axis=2)  # [NW, GP] in SliceLayout(2, MG): the trailing axis is one wide
    l = gl.sum(sl.load(MG), axis=2)
    ow = so.load(MG)
    mx = gl.max(m, axis=0)  # [GP]: the warp axis inside each thread
    wn = gl.exp2(m - gl.expand_dims(mx, 0))
    l_f = gl.sum(l * wn, axis=0)
    o_f = gl.sum(ow * gl.expand_dims(wn, 2), axis=0)  # [GP, HD]
    return mx, l_f, o_f


@gluon.jit
def _reduce(kvh, n_splits, b, po_ptr, pml_ptr, attn_ptr, C: gl.constexpr):
    """The combining split: the G heads of KV group ``kvh`` combined over splits [0, n_splits): attn[h] =
    sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s (``combine``), every partial loaded in one round of independent
    loads, stored to the attention output."""
    G: gl.constexpr = C.G
    HD: gl.constexpr = C.HD
    R3: gl.constexpr = layouts.combine(C)
    GS: gl.constexpr = gl.SliceLayout(2, R3)  # [GP, SP2]
    GD: gl.constexpr = gl.SliceLayout(1, R3)  # [GP, HD]
    offs_g = gl.arange(0, C.GP, gl.SliceLayout(1, GS))
    offs_s = gl.arange(0, C.SP2, gl.SliceLayout(0, GS))
    base = gl.expand_dims((kvh * G + offs_g) * b.splits, 1) + gl.expand_dims(offs_s, 0)  # [GP, SP2]
    valid = gl.expand_dims(offs_g < G, 1) & gl.expand_dims(offs_s < n_splits, 0)
    ms = gl.load(pml_ptr + base * 2, mask=valid, other=EMPTY_M_D, cache_modifier=".cg")
    ls = gl.load(pml_ptr + base * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
    offs_d = gl.arange(0, HD, gl.SliceLayout(0, GD))
    d3 = gl.expand_dims(gl.expand_dims(offs_d, 0), 1)  # [1, 1, HD]
    po = gl.load(po_ptr + gl.expand_dims(base * HD, 2) + d3, mask=gl.expand_dims(valid, 2), other=0.0,
                 cache_modifier=".cg")  # [GP, SP2, HD]
    mx = gl.max(ms, axis=1)
    w = gl.exp2((ms - gl.expand_dims(mx, 1)) * LOG2E)
    den = gl.sum(w * ls, axis=1)
    o = gl.sum(gl.expand_dims(w, 2) * po, axis=1)  # [GP, HD]
    o = o / gl.expand_dims(gl.convert_layout(den, gl.SliceLayout(1, GD)), 1)
    offs_og = gl.arange(0, C.GP, gl.SliceLayout(1, GD))
    out = attn_ptr + gl.expand_dims((kvh * G + offs_og) * HD, 1) + gl.expand_dims(offs_d, 0)
    gl.store(out, o, mask=gl.expand_dims(offs_og < G, 1) & gl.expand_dims(offs_d >= 0, 0))
