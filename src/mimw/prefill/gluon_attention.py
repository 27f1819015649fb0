"""mimw's paged prefill attention for Hopper in Gluon: FlashAttention-3's forward shape (TMA producer, mbarrier
rings, async wgmma, softmax overlapped with the tensor cores) over the paged KV cache, with ``PagedAttention``'s
interface and semantics (``paged_attention.py``): every piece's queries attend causally to everything their sequence
holds (the prefix in the cache and the piece itself), GQA, block tables, any number of pieces a pass.

Roles (``gl.warp_specialize``), one CTA a program:
  producer (1 warp, 24 registers): the program's Q block by TMA, then for every key tile K then V: reads the tile's
      BLOCK_N / 16 page numbers from the block table (one vector load, issued a tile ahead so its round trip hides
      behind the ring waits), waits for the slot to be free, sets the slot's expected bytes, and issues one TMA box
      per page and 64-column chunk. The layer [P, Hkv, PS, hd] is seen as [P * Hkv * PS, hd]: page ``page`` of KV
      head h is the contiguous [16, hd] box at row (page * Hkv + h) * 16, so a [BLOCK_N, 64] tile chunk is
      BLOCK_N / 16 boxes into one 128-byte-swizzled shared tile (each box lands on a 2 KB boundary of the swizzle
      pattern) and the block table is the only per-key address arithmetic, done by one warp off the critical path.
  consumers (WGS warpgroups of 4 warps: the default partition and workers; 3 at head_dim 64, 2 at 128): warpgroup w
      owns query rows [64 w, 64 w + 64) of the program's 64 WGS-row block and runs the whole FlashAttention loop
      for them over the SAME K/V tiles (a slot is free once every warpgroup released it: the empty barriers count
      WGS). The warpgroups never wait for each other's data inside the loop, so one's softmax runs while another's
      wgmmas hold the tensor cores; three give each scheduler three consumer warps to hide the softmax's latencies.
  Inside a warpgroup the loop is software-pipelined (FlashAttention-3's intra-warpgroup overlap): iteration j
      issues S_j = Q K_j^T (async wgmma, Q and K from shared memory) and then O += P_{j-1} V_{j-1} (async wgmma,
      P from registers: the fp32 score accumulator's layout is the A operand's, so P never touches shared memory),
      waits for S_j only, releases K_j, runs tile j's online softmax while the PV wgmma is still in flight, then
      waits for it, releases V_{j-1} and rescales O for tile j.
  Turns (FlashAttention-3's ping-pong): the warpgroups issue an iteration's wgmmas in turns, in a round, handed
      over on one-arrival mbarriers (``turn[w]``: warpgroup w may issue; the kernel arrives once on turn[0], each
      warpgroup arrives on the next one's after issuing), so the tensor cores run one warpgroup's QK and PV while
      the others' softmax runs. Left to drift freely the two contend for the tensor cores and the exp2
      units at the same time: attention alone at 32k on an H100 ran 459 / 445 TFLOP/s at hd 64 and 556 at hd 128
      without the turns, 473 / 453 and 639 with them (bench/NOTES.md, p3).

Shared memory: Q [WGS warpgroups x HD/64 chunks, 64, 64], K and V rings of ``stages`` slots of [HD/64, BLOCK_N, 64]
each (a head dim of 128 is two 64-column chunks, each its own swizzled tile, so every TMA box and every wgmma operand
is a plain 128-byte-swizzled [rows, 64] tile; S_j accumulates over the chunks, O is one [64, 64] accumulator a
chunk). Barriers: q_bar (the Q block landed), k_ready / v_ready[slot] (TMA bytes landed, phase (j // stages) & 1),
k_empty / v_empty[slot] (every warpgroup's wgmmas reading the slot completed; the producer's first pass waits the
phase before 0 and passes), v_fixed (below), turn[WGS] (above). Tiles (``GluonTiles.for_head_dim``): hd 64: three
warpgroups, BLOCK_N 64, 8 stages (24 + 8 x 16 KB); hd 128: two, BLOCK_N 128, 2 stages (32 + 2 x 64 KB; a third
does not fit the SM's 227 KB). A warpgroup's [64, BLOCK_N] fp32 score tile is BLOCK_N / 2 registers a thread, P
half that, O 32 (hd 64) or 64 (hd 128), all alive at once beside the previous P, hence the 24-register producer
warpgroup (setmaxnreg; the launch's warps are the consumers' and the producer's, padded to warpgroups): two
consumer warpgroups get 232 registers a worker thread (the default partition the rest, 248), three get 160
(the default 168), where a 128-key tile would spill.

Masks: a program's query rows sit at positions start + m0 .. start + m0 + 64 WGS - 1 and see keys 0 .. their own
position, so tiles below floor((start + m0) / BLOCK_N) are seen whole (no mask in the loop) and only the tiles from
there to hi = min(ctx, start + m0 + 64 WGS) take the causal mask (select to -inf, so a key past the context that
reads as NaN is dropped, not multiplied). The last tile of a sequence reaches past its context: those V rows are
whatever the pages hold (possibly NaN, and 0 x NaN is NaN), so before that tile's PV wgmma warpgroups 0 and 1 zero
a half each of the tile's rows past the context in shared memory, fence them to the async proxy and all meet on
``v_fixed``.

Grid: one program per (query head, 64 WGS-row query block), axis 0 the query head, as the Triton kernel: the heads of
one block run together and share each KV head's tiles through L2; the work list (``PrefillBatch.work``) puts the
blocks with the most keys first, so the longest programs start first and the grid's tail is short. (A persistent
grid would also overlap one block's prologue and epilogue with the next block's loads, a few % at 32k where a
program runs ~128 tiles; not done.) Passes whose longest piece has at most GROUPED_ROWS (128) rows (decode batches,
verify blocks) run on the Triton kernel's grouped path (``paged_attention.query_rows``: one KV head's GQA group a
program), which fills a tile with real queries where this kernel would compute 64 WGS rows for one.

Numerics as the Triton kernel's: scores scaled by log2(e)/sqrt(hd) and exponentiated with exp2, the max taken on
unscaled scores (scale and shift are one FMA), running max, sum and O in fp32, P rounded to bf16 for the PV wgmma.
bf16 cache only: over an fp8 cache ``GluonAttention`` runs the Triton kernel (the rows' scales would
have to be applied between the TMA and the wgmma: a dequantising pass over shared memory, not built).
PyTorch reference: ``attend_torch`` walks the same programs, tiles, masks and pipeline order in fp32 (its tests
diff it against ``gathered_attention.torch_attention``, the reference decoder's attention); the GPU tests diff the
kernel through the runner against the fp32 reference decoder.
"""

import math
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from .batch import PrefillBatch
from .paged_attention import PagedAttention

GROUPED_ROWS = 128  # passes whose pieces have at most this many rows run on the Triton kernel's grouped path
WG_ROWS = 64  # query rows a consumer warpgroup (wgmma's M)
CHUNK = 64  # head-dim columns a shared tile: one 128-byte swizzle row of bf16
PRODUCER_REGS = gl.constexpr(24)
# a consumer thread's registers (setmaxnreg): the 64K less the producer warpgroup's, shared by two consumer
# warpgroups (232 a worker thread) or three (160)
CONSUMER_REGS_2 = gl.constexpr(232)
CONSUMER_REGS_3 = gl.constexpr(160)


@dataclass(frozen=True)
class GluonTiles:
    """The kernel's shape constants (a constexpr of the launch): head dim, GQA group, KV heads, page size, key tile,
    ring depth and consumer warpgroups (64 query rows each)."""

    HD: int
    GROUP: int
    HKV: int
    PS: int = 16
    BLOCK_N: int = 128
    NB: int = 2
    WGS: int = 2

    @classmethod
    def for_head_dim(cls, head_dim: int, group: int, kv_heads: int, page_size: int = 16) -> "GluonTiles":
        """Shared memory: Q (block_m x head_dim x 2 bytes) plus stages x 2 x BLOCK_N x head_dim x 2 bytes within
        227 KB. hd 64: three consumer warpgroups (192 query rows) over key tiles of 64 in 8 stages (at 160
        registers a thread, a 128-key tile's scores, P and O leave too few: ptxas spills); hd 128: two warpgroups
        (O takes twice the registers), key tiles of 128 in 2 stages."""
        if head_dim <= 64:
            return cls(head_dim, group, kv_heads, page_size, 64, 8, 3)
        return cls(head_dim, group, kv_heads, page_size, 128, 2, 2)

    def __post_init__(self) -> None:
        if self.HD not in (64, 128):
            raise ValueError(f"the Gluon attention takes head_dim 64 or 128, got {self.HD}")
        if self.PS < 8 or self.PS & (self.PS - 1) or self.BLOCK_N % self.PS or self.BLOCK_N not in (64, 128):
            raise ValueError(f"page_size must be a power of two >= 8 dividing BLOCK_N (64 or 128), got "
                             f"{self.PS}, {self.BLOCK_N}")
        if self.WGS not in (2, 3) or (self.WGS == 3 and self.HD != 64):
            raise ValueError(f"the Gluon attention runs 2 consumer warpgroups, or 3 at head_dim 64, got {self.WGS} "
                             f"at {self.HD}")

    @property
    def block_m(self) -> int:
        """Query rows a program."""
        return WG_ROWS * self.WGS

    @property
    def HC(self) -> int:
        """64-column chunks of the head dim."""
        return self.HD // CHUNK

    @property
    def shared_bytes(self) -> int:
        return 2 * (self.block_m * self.HD + 2 * self.NB * self.BLOCK_N * self.HD)


@aggregate
class Ring:
    """The shared state of a program: Q, the K and V rings, their barriers."""

    q: gl.shared_memory_descriptor  # [WGS * HC, 64, 64] bf16: warpgroup w's chunk c at w * HC + c
    k: gl.shared_memory_descriptor  # [NB * HC, BLOCK_N, 64] bf16: slot s's chunk c at s * HC + c
    v: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor  # [1, 1]
    k_ready: gl.shared_memory_descriptor  # [NB, 1] each
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    v_fixed: gl.shared_memory_descriptor  # [1, 1]: both warpgroups zeroed the last tile's V rows past the context
    turn: gl.shared_memory_descriptor  # [WGS, 1]: warpgroup w may issue its next tile's wgmmas

    @gluon.constexpr_function
    def __init__(self, q, k, v, q_bar, k_ready, k_empty, v_ready, v_empty, v_fixed, turn):
        self.q = q
        self.k = k
        self.v = v
        self.q_bar = q_bar
        self.k_ready = k_ready
        self.k_empty = k_empty
        self.v_ready = v_ready
        self.v_empty = v_empty
        self.v_fixed = v_fixed
        self.turn = turn


@aggregate
class Block:
    """One program's query block: query head ``hx`` (KV head ``kvh``) of piece ``seg``, rows m0 .. m0 + 127 of the
    piece (pass rows row0 + m0 ..), positions start + m0 ..; keys 0 .. ctx - 1; ``n_tiles`` key tiles cover
    [0, hi), the first ``n_full`` seen whole by every row."""

    hx: gl.tensor
    kvh: gl.tensor
    seg: gl.tensor
    m0: gl.tensor
    row0: gl.tensor
    start: gl.tensor
    ctx: gl.tensor
    n_tiles: gl.tensor
    n_full: gl.tensor

    @gluon.constexpr_function
    def __init__(self, hx, kvh, seg, m0, row0, start, ctx, n_tiles, n_full):
        self.hx = hx
        self.kvh = kvh
        self.seg = seg
        self.m0 = m0
        self.row0 = row0
        self.start = start
        self.ctx = ctx
        self.n_tiles = n_tiles
        self.n_full = n_full


@gluon.constexpr_function
def tile_layout():
    """Every shared tile: bf16 rows of 64 columns (128 bytes), 128-byte swizzle: TMA's and wgmma's layout."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.constexpr_function
def s_layout(BLOCK_N):
    """A warpgroup's [64, BLOCK_N] fp32 scores: wgmma's accumulator, one m64 n BLOCK_N instruction per k16."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])


@gluon.constexpr_function
def o_layout():
    """A warpgroup's [64, 64] fp32 output chunk: wgmma's accumulator."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, CHUNK, 16])


@gluon.constexpr_function
def p_layout():
    """P [64, BLOCK_N] bf16 as the PV wgmma's register A operand (the score accumulator's own register layout)."""
    return gl.DotOperandLayout(operand_index=0, parent=o_layout(), k_width=2)


@gluon.constexpr_function
def fix_layout():
    """[rows, 64] bf16 of a V tile read and rewritten by a warpgroup: 8 columns (16 bytes) a thread."""
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _field(v, offs, b: gl.constexpr):
    """Element b of the small vector v as a scalar (a warp reduction)."""
    return gl.sum(gl.where(offs == b, v, 0), axis=0)


@gluon.jit
def _load_tile(desc, empty, ready, buf, s, free, rows, offs, C: gl.constexpr):
    """One key tile of K (or V) into ring slot ``s``: wait for the slot to be free, set its expected bytes, then one
    TMA box a page (``rows``: each box's first cache row) and 64-column chunk."""
    HC: gl.constexpr = C.HD // 64
    NPG: gl.constexpr = C.BLOCK_N // C.PS
    PS: gl.constexpr = C.PS
    mbarrier.wait(empty, free)
    mbarrier.expect(ready, C.BLOCK_N * C.HD * 2)
    for b in gl.static_range(NPG):
        r = _field(rows, offs, b)
        for c in gl.static_range(HC):
            tma.async_copy_global_to_shared(desc, [r, 64 * c], ready, buf.index(s * HC + c).slice(b * PS, PS))


@gluon.jit
def _produce(ring, blk, q_desc, k_desc, v_desc, BT, stride_bt, C: gl.constexpr):
    """The producer warp (module doc): Q, then K and V of every key tile, in order."""
    HC: gl.constexpr = C.HD // 64
    NPG: gl.constexpr = C.BLOCK_N // C.PS  # pages a key tile
    NB: gl.constexpr = C.NB
    L: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    WGS: gl.constexpr = C.WGS
    mbarrier.expect(ring.q_bar.index(0), WGS * HC * 64 * 64 * 2)
    for w in gl.static_range(WGS):
        for c in gl.static_range(HC):  # rows past the pass's last one read as zeros (TMA bounds)
            tma.async_copy_global_to_shared(q_desc, [blk.row0 + blk.m0 + 64 * w, blk.hx * C.HD + 64 * c],
                                            ring.q_bar.index(0), ring.q.index(w * HC + c))
    offs = gl.arange(0, NPG, L)
    bt = BT + blk.seg.to(gl.int64) * stride_bt
    n_pages = (blk.ctx + C.PS - 1) // C.PS  # the table's entries for this sequence; later ones read page 0
    pages = gl.load(bt + offs, mask=offs < n_pages, other=0)
    for j in range(blk.n_tiles):
        rows = (pages * C.HKV + blk.kvh) * C.PS  # [NPG] first cache rows of the tile's boxes
        nxt = (j + 1) * NPG + offs  # the next tile's pages: in flight while this tile waits for its slots
        pages = gl.load(bt + nxt, mask=nxt < n_pages, other=0)
        s = j % NB
        free = ((j // NB) & 1) ^ 1
        _load_tile(k_desc, ring.k_empty.index(s), ring.k_ready.index(s), ring.k, s, free, rows, offs, C)
        _load_tile(v_desc, ring.v_empty.index(s), ring.v_ready.index(s), ring.v, s, free, rows, offs, C)


@gluon.jit
def _take_turn(ring, t, WG: gl.constexpr):
    """Wait for turn t of this warpgroup (completion t of its turn barrier: the kernel's first arrival for
    warpgroup 0's turn 0; then the warpgroup before it in the round, WG - 1's turn t, or the last warpgroup's turn
    t - 1 for warpgroup 0, handing over)."""
    mbarrier.wait(ring.turn.index(WG), t & 1)


@gluon.jit
def _pass_turn(ring, WG: gl.constexpr, C: gl.constexpr):
    """This warpgroup's wgmmas of the turn are issued; the next warpgroup of the round may issue its own."""
    mbarrier.arrive(ring.turn.index((WG + 1) % C.WGS), count=1)


@gluon.jit
def _scores(ring, j, WG: gl.constexpr, C: gl.constexpr):
    """Issue S_j = Q K_j^T for this warpgroup's rows (async; one wgmma group a 64-column chunk) once K_j landed."""
    HC: gl.constexpr = C.HD // 64
    BN: gl.constexpr = C.BLOCK_N
    s = j % C.NB
    mbarrier.wait(ring.k_ready.index(s), (j // C.NB) & 1)
    _take_turn(ring, j, WG)
    acc = gl.zeros([64, BN], gl.float32, s_layout(BN))
    acc = warpgroup_mma(ring.q.index(WG * HC), ring.k.index(s * HC).permute((1, 0)), acc, use_acc=False,
                        is_async=True)
    if HC == 2:
        acc = warpgroup_mma(ring.q.index(WG * HC + 1), ring.k.index(s * HC + 1).permute((1, 0)), acc,
                            is_async=True)
    return acc


@gluon.jit
def _pv(ring, p, o0, o1, j, C: gl.constexpr):
    """Issue O += P_j V_j (async; one wgmma group a 64-column chunk of O); V_j must have landed."""
    HC: gl.constexpr = C.HD // 64
    s = j % C.NB
    o0 = warpgroup_mma(p, ring.v.index(s * HC), o0, is_async=True)
    if HC == 2:
        o1 = warpgroup_mma(p, ring.v.index(s * HC + 1), o1, is_async=True)
    return o0, o1


@gluon.jit
def _to_bf16(x):
    """fp32 -> bf16, round to nearest even, two elements an instruction (one packed register: element 0 low)."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16, is_pure=True,
                                     pack=2)


@gluon.jit
def _softmax(acc, m_i, l_i, n0, pos0, ctx, qk_scale, MASKED: gl.constexpr, C: gl.constexpr):
    """Tile scores -> (P fp32, new running max, new running sum, the rescale of O), the max on unscaled scores,
    one FMA and an exp2 a score (``_operand`` makes P the PV wgmma's operand). MASKED: keys past a row's position
    or the context are dropped (select: a NaN score of a key past the context goes too)."""
    BN: gl.constexpr = C.BLOCK_N
    if MASKED:
        kpos = n0 + gl.arange(0, BN, gl.SliceLayout(0, s_layout(BN)))
        kp = gl.expand_dims(kpos, 0)
        q_pos = pos0 + gl.arange(0, 64, gl.SliceLayout(1, s_layout(BN)))  # the warpgroup's rows' positions
        ok = (kp <= gl.expand_dims(q_pos, 1)) & (kp < ctx)
        acc = gl.where(ok, acc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(acc, axis=1) * qk_scale)
    p = gl.exp2(acc * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _operand(p):
    """P fp32 -> bf16 in the PV wgmma's register operand layout (the score accumulator's own registers)."""
    return gl.convert_layout(_to_bf16(p), p_layout())


@gluon.jit
def _rescale(o, alpha):
    a = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout()))
    return o * gl.expand_dims(a, 1)


@gluon.jit
def _tile(ring, blk, j, p, o0, o1, m_i, l_i, pos0, qk_scale, WG: gl.constexpr, MASKED: gl.constexpr,
          C: gl.constexpr):
    """Pipelined iteration j >= 1: S_j and PV_{j-1} in flight together, tile j's softmax beside PV_{j-1}."""
    HC: gl.constexpr = C.HD // 64
    acc = _scores(ring, j, WG, C)
    sp = (j - 1) % C.NB
    mbarrier.wait(ring.v_ready.index(sp), ((j - 1) // C.NB) & 1)
    o0, o1 = _pv(ring, p, o0, o1, j - 1, C)
    _pass_turn(ring, WG, C)
    acc = warpgroup_mma_wait(num_outstanding=HC, deps=(acc,))  # S_j done, PV_{j-1} may still run
    mbarrier.arrive(ring.k_empty.index(j % C.NB), count=1)
    p_new, m_i, l_i, alpha = _softmax(acc, m_i, l_i, j * C.BLOCK_N, pos0, blk.ctx, qk_scale, MASKED, C)
    if HC == 2:
        o0, o1, p = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, p))
    else:
        o0, p = warpgroup_mma_wait(num_outstanding=0, deps=(o0, p))
    p_new = _operand(p_new)  # into the registers PV_{j-1} read until the wait
    mbarrier.arrive(ring.v_empty.index(sp), count=1)
    o0 = _rescale(o0, alpha)
    if HC == 2:
        o1 = _rescale(o1, alpha)
    return p_new, o0, o1, m_i, l_i


@gluon.jit
def _zero_past_context(ring, blk, s, WG: gl.constexpr, C: gl.constexpr):
    """The last tile: the V slot's rows at positions >= ctx set to zero (warpgroups 0 and 1 a half each), fenced
    for the async proxy; then every warpgroup meets on v_fixed before any PV wgmma reads the slot."""
    HC: gl.constexpr = C.HD // 64
    HALF: gl.constexpr = C.BLOCK_N // 2
    FL: gl.constexpr = fix_layout()
    if WG < 2:
        n0 = (blk.n_tiles - 1) * C.BLOCK_N
        r = gl.expand_dims(gl.arange(0, HALF, gl.SliceLayout(1, FL)), 1) + WG * HALF
        for c in gl.static_range(HC):
            rows = ring.v.index(s * HC + c).slice(WG * HALF, HALF)
            x = rows.load(FL)
            rows.store(gl.where(n0 + r < blk.ctx, x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ring.v_fixed.index(0), count=1)
    mbarrier.wait(ring.v_fixed.index(0), 0)


@gluon.jit
def _consume(ring, blk, O, stride_ot, stride_oh, qk_scale, WG: gl.constexpr, C: gl.constexpr):
    """Consumer warpgroup WG (module doc): rows [64 WG, 64 WG + 64) of the block, every key tile, then the store."""
    HC: gl.constexpr = C.HD // 64
    BN: gl.constexpr = C.BLOCK_N
    SL: gl.constexpr = s_layout(BN)
    OL: gl.constexpr = o_layout()
    pos0 = blk.start + blk.m0 + WG * 64  # the position of the warpgroup's first row (a scalar: a row vector
    # held through the unmasked tiles would take registers the softmax needs)
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, SL))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, SL))
    o0 = gl.zeros([64, 64], gl.float32, OL)
    o1 = gl.zeros([64, 64], gl.float32, OL)
    mbarrier.wait(ring.q_bar.index(0), 0)
    # tile 0: every row sees key 0, so each running max is finite from here on; masked in case it is the diagonal
    acc = _scores(ring, 0, WG, C)
    _pass_turn(ring, WG, C)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(ring.k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(acc, m_i, l_i, 0, pos0, blk.ctx, qk_scale, True, C)
    p = _operand(p)
    for j in range(1, blk.n_full):
        p, o0, o1, m_i, l_i = _tile(ring, blk, j, p, o0, o1, m_i, l_i, pos0, qk_scale, WG, False, C)
    for j in range(gl.maximum(blk.n_full, 1), blk.n_tiles):
        p, o0, o1, m_i, l_i = _tile(ring, blk, j, p, o0, o1, m_i, l_i, pos0, qk_scale, WG, True, C)
    last = blk.n_tiles - 1
    s = last % C.NB
    mbarrier.wait(ring.v_ready.index(s), (last // C.NB) & 1)
    if blk.n_tiles * C.BLOCK_N > blk.ctx:
        _zero_past_context(ring, blk, s, WG, C)
    o0, o1 = _pv(ring, p, o0, o1, last, C)
    if HC == 2:
        o0, o1, p = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, p))
    else:
        o0, p = warpgroup_mma_wait(num_outstanding=0, deps=(o0, p))
    inv = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, OL))
    ro = gl.arange(0, 64, gl.SliceLayout(1, OL))
    d = gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(0, OL)), 0)
    mrow = blk.m0 + WG * 64 + ro
    valid = gl.expand_dims(mrow < blk.ctx - blk.start, 1) & (d < 64)
    ptr = O + gl.expand_dims((blk.row0 + mrow).to(gl.int64) * stride_ot, 1) + blk.hx * stride_oh + d
    gl.store(ptr, (o0 * gl.expand_dims(inv, 1)).to(gl.bfloat16), mask=valid)
    if HC == 2:
        gl.store(ptr + 64, (o1 * gl.expand_dims(inv, 1)).to(gl.bfloat16), mask=valid)


@gluon.jit
def _consume_wg1(ring, blk, O, stride_ot, stride_oh, qk_scale, C: gl.constexpr):
    _consume(ring, blk, O, stride_ot, stride_oh, qk_scale, 1, C)


@gluon.jit
def _consume_wg2(ring, blk, O, stride_ot, stride_oh, qk_scale, C: gl.constexpr):
    _consume(ring, blk, O, stride_ot, stride_oh, qk_scale, 2, C)


@gluon.jit
def gluon_prefill_kernel(q_desc, k_desc, v_desc, O, BT, Q_START, SEQ_START, SEQ_CTX, WORK,
                         stride_ot, stride_oh, stride_bt, qk_scale, C: gl.constexpr):
    HC: gl.constexpr = C.HD // 64
    NB: gl.constexpr = C.NB
    BN: gl.constexpr = C.BLOCK_N
    hx = gl.program_id(0)
    w = gl.program_id(1)
    seg = gl.load(WORK + 2 * w)
    m0 = gl.load(WORK + 2 * w + 1)
    start = gl.load(SEQ_START + seg)
    ctx = gl.load(SEQ_CTX + seg)
    hi = gl.minimum(ctx, start + m0 + C.WGS * 64)
    blk = Block(hx, hx // C.GROUP, seg, m0, gl.load(Q_START + seg), start, ctx, (hi + C.BLOCK_N - 1) // C.BLOCK_N,
                (start + m0) // C.BLOCK_N)
    TL: gl.constexpr = tile_layout()
    BL: gl.constexpr = mbarrier.MBarrierLayout()
    ring = Ring(gl.allocate_shared_memory(gl.bfloat16, [C.WGS * HC, 64, 64], TL),
                gl.allocate_shared_memory(gl.bfloat16, [NB * HC, BN, 64], TL),
                gl.allocate_shared_memory(gl.bfloat16, [NB * HC, BN, 64], TL),
                gl.allocate_shared_memory(gl.int64, [1, 1], BL),
                gl.allocate_shared_memory(gl.int64, [NB, 1], BL),
                gl.allocate_shared_memory(gl.int64, [NB, 1], BL),
                gl.allocate_shared_memory(gl.int64, [NB, 1], BL),
                gl.allocate_shared_memory(gl.int64, [NB, 1], BL),
                gl.allocate_shared_memory(gl.int64, [1, 1], BL),
                gl.allocate_shared_memory(gl.int64, [C.WGS, 1], BL))
    mbarrier.init(ring.q_bar.index(0), count=1)
    WGS: gl.constexpr = C.WGS
    mbarrier.init(ring.v_fixed.index(0), count=WGS)
    for w in gl.static_range(WGS):
        mbarrier.init(ring.turn.index(w), count=1)
    mbarrier.arrive(ring.turn.index(0), count=1)  # warpgroup 0 takes the first turn
    for i in gl.static_range(NB):
        mbarrier.init(ring.k_ready.index(i), count=1)
        mbarrier.init(ring.v_ready.index(i), count=1)
        mbarrier.init(ring.k_empty.index(i), count=C.WGS)  # one arrival a consumer warpgroup
        mbarrier.init(ring.v_empty.index(i), count=C.WGS)
    if C.WGS == 3:
        gl.warp_specialize([
            (_consume, (ring, blk, O, stride_ot, stride_oh, qk_scale, 0, C)),
            (_consume_wg1, (ring, blk, O, stride_ot, stride_oh, qk_scale, C)),
            (_consume_wg2, (ring, blk, O, stride_ot, stride_oh, qk_scale, C)),
            (_produce, (ring, blk, q_desc, k_desc, v_desc, BT, stride_bt, C)),
        ], [4, 4, 1], [CONSUMER_REGS_3, CONSUMER_REGS_3, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consume, (ring, blk, O, stride_ot, stride_oh, qk_scale, 0, C)),
            (_consume_wg1, (ring, blk, O, stride_ot, stride_oh, qk_scale, C)),
            (_produce, (ring, blk, q_desc, k_desc, v_desc, BT, stride_bt, C)),
        ], [4, 1], [CONSUMER_REGS_2, PRODUCER_REGS])


def _descriptor(x: torch.Tensor, block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                                       rank=2))


def gluon_prefill_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch,
                            tiles: GluonTiles | None = None) -> torch.Tensor:
    """q [T, Hq, hd] bf16 (rows of ``batch``); k_layer, v_layer [P, Hkv, PS, hd] bf16 -> o [T, Hq, hd] bf16."""
    t, hq, hd = q.shape
    _, hkv, ps, _ = k_layer.shape
    tiles = tiles or GluonTiles.for_head_dim(hd, hq // hkv, hkv, ps)
    if q.dtype != torch.bfloat16 or k_layer.dtype != torch.bfloat16 or v_layer.dtype != torch.bfloat16:
        raise ValueError(f"the Gluon attention takes bf16 q and a bf16 cache, got {q.dtype} and {k_layer.dtype}")
    if not (k_layer.is_contiguous() and v_layer.is_contiguous()):
        raise ValueError("the Gluon attention needs contiguous cache layers (a page of a head is one TMA box)")
    if (tiles.HD, tiles.GROUP, tiles.HKV, tiles.PS) != (hd, hq // hkv, hkv, ps):
        raise ValueError(f"tiles {tiles} do not match q {tuple(q.shape)} and the cache {tuple(k_layer.shape)}")
    q = q.contiguous()
    o = torch.empty_like(q)
    work = batch.work(tiles.block_m)
    q_desc = _descriptor(q.view(t, hq * hd), [WG_ROWS, CHUNK])
    k_desc = _descriptor(k_layer.view(-1, hd), [ps, CHUNK])
    v_desc = _descriptor(v_layer.view(-1, hd), [ps, CHUNK])
    gluon_prefill_kernel[(hq, work.shape[0])](
        q_desc, k_desc, v_desc, o, batch.block_tables, batch.q_start, batch.seq_start, batch.seq_ctx, work,
        o.stride(0), o.stride(1), batch.block_tables.stride(0), math.log2(math.e) / math.sqrt(hd), C=tiles,
        num_warps=4)
    return o


class GluonAttention:
    """``gluon_prefill_attention`` with fixed tiles (None: ``GluonTiles.for_head_dim``) behind the runner's per-pass
    ``plan``. Two cases take the paged Triton kernel instead, as their shapes force: a pass whose longest piece has
    at most GROUPED_ROWS rows (its grouped path fills a tile with real queries; module doc) and an fp8 cache (the Triton
    kernel dequantises each row with its scale as it loads it; this kernel's wgmmas read TMA's tiles as they land)."""

    def __init__(self, tiles: GluonTiles | None = None):
        self.tiles = tiles
        self._triton = PagedAttention()

    def plan(self, batch: PrefillBatch):
        triton_run = self._triton.plan(batch)
        if max(p.length for p in batch.pieces) <= GROUPED_ROWS:
            return triton_run

        def run(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
            if k_scale is not None or v_scale is not None:
                return triton_run(q, k_layer, v_layer, k_scale, v_scale)
            return gluon_prefill_attention(q, k_layer, v_layer, batch, self.tiles)

        return run


def attend_torch(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch,
                 block_n: int = 128, block_m: int | None = None) -> torch.Tensor:
    """The kernel's walk in PyTorch (fp32, P rounded to bf16): the same programs (``batch.work(block_m)``, default
    ``GluonTiles.for_head_dim``'s), block
    table reads (pages past the sequence's read as page 0), boxes, masked tiles (tile 0 and those from n_full on),
    zeroed V rows past the context in the last tile, and the pipelined order of the rescale (O_j = (O_{j-1} +
    P_{j-1} V_{j-1}) alpha_j, the last PV added after the loop). q [T, Hq, hd]; layers [P, Hkv, PS, hd]."""
    t, hq, hd = q.shape
    _, hkv, ps, _ = k_layer.shape
    bm = block_m or GluonTiles.for_head_dim(hd, hq // hkv, hkv, ps).block_m
    kr, vr = k_layer.reshape(-1, hd).float(), v_layer.reshape(-1, hd).float()
    scale = math.log2(math.e) / math.sqrt(hd)
    o = torch.full_like(q, float("nan"))
    q_start, seq_start, seq_ctx = (x.tolist() for x in (batch.q_start, batch.seq_start, batch.seq_ctx))
    tables = batch.block_tables.tolist()
    for seg, m0 in batch.work(bm).tolist():
        row0, start, ctx = q_start[seg], seq_start[seg], seq_ctx[seg]
        hi = min(ctx, start + m0 + bm)
        n_tiles, n_full, n_pages = -(-hi // block_n), (start + m0) // block_n, -(-ctx // ps)
        rows = torch.arange(row0 + m0, row0 + m0 + bm)
        q_pos = (start + m0 + torch.arange(bm))[:, None]
        for hx in range(hq):
            kvh = hx // (hq // hkv)
            qb = torch.zeros(bm, hd)  # rows past the pass's last one: TMA's zeros
            qb[rows < t] = q[rows[rows < t], hx].float()
            m_i, l_i = torch.full((bm, 1), float("-inf")), torch.zeros(bm, 1)
            acc, pv = torch.zeros(bm, hd), None
            for j in range(n_tiles):
                n0 = j * block_n
                pidx = n0 // ps + torch.arange(block_n // ps)
                pages = torch.tensor([tables[seg][i] if i < n_pages else 0 for i in pidx.tolist()])
                box = ((pages * hkv + kvh) * ps)[:, None] + torch.arange(ps)  # [pages a tile, PS] cache rows
                k, v = kr[box.flatten()], vr[box.flatten()].clone()
                kpos = n0 + torch.arange(block_n)[None, :]
                if j == n_tiles - 1:
                    v[kpos[0] >= ctx] = 0.0
                s = qb @ k.T
                if j == 0 or j >= n_full:
                    s = torch.where((kpos <= q_pos) & (kpos < ctx), s, float("-inf"))
                m_new = torch.maximum(m_i, s.amax(1, keepdim=True) * scale)
                p = torch.exp2(s * scale - m_new)
                alpha = torch.exp2(m_i - m_new)
                l_i = l_i * alpha + p.sum(1, keepdim=True)
                if pv is not None:
                    acc = (acc + pv) * alpha
                pv = p.bfloat16().float() @ v
                m_i = m_new
            acc = acc + pv
            keep = (rows < t) & (torch.arange(bm) + m0 < ctx - start)
            o[rows[keep], hx] = (acc / l_i)[keep].to(q.dtype)
    return o
