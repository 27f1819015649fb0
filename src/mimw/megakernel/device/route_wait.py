"""The loader's wait on a layer's routing entry, and what it streams meanwhile: L2 prefetches of the weight tiles its
queue needs next that do not depend on the router.

An MoE layer's first expert span (isa.EXPERT_SPAN) is the one place the loader waits on step data (device/ring.py):
its expert is known once the layer's ROUTER finisher has stored the routing entry. The ring cannot take anything
meanwhile: it is consumed in queue order, and the expert tiles come first. But the memory system can: the next
instructions of the queue that are not expert spans (the next layer's ATTN_IN and O_PROJ, a ROUTER part) name
their tiles in their words, and each tile is 16 contiguous KB of the packed tile array (rows [tile * BR, +BR) of
the descriptor's [*, 32] view of ``tiles``), so one lane asks L2 for it with ``cp.async.bulk.prefetch.L2.global``
(sm_90, no shared memory, no barrier). The ring's later TMA of that tile then finds it in L2, as long as the
traffic between (the layer's expert tiles: ~75 MB at the 30B-A3B's batch 1, more than an H100's 50 MB of L2) has
not evicted it: whether it survives is what the A/B measurement (Tuning.moe_prefetch_kb = 0, the default,
against 128) decides; the prefetch stays only if it pays (bench/NOTES.md).

Pacing: the wait alternates a poll of the entry with one step of the scan: one tile prefetched, or one queue entry
read. Each poll is an L2 round trip, so an SM asks for about one 16 KB tile a round trip (~0.7 us: 132 SMs together
near the HBM's rate), never a burst ahead of the tiles and K/V already in flight, and it stops the moment the entry
is tagged, so the expert tiles never queue behind prefetches. At most ``BUDGET`` tiles a wait (the plan's
``PREFETCH``: Tuning.moe_prefetch_kb of tiles). Prefetches touch neither the ring nor any barrier and are only
hints, so the ring's order and its deadlock argument (device/ring.py) are unchanged.

Traced (``C.TRACE``), each layer's first wait stores [the globaltimer once the entry is tagged, the ns since the
first poll, the tiles prefetched] at ``waits[sm, layer]`` (tools/trace.py: the routing wait per layer).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function

from .context import EXPERT_SPAN, NO_EXPERT, NWORDS, ROUTE_BITS, W_FLAGS, W_K0, W_K1, W_KT, W_NR, W_T0, Ins
from .sync import globaltimer, routed_wait

WAIT_STAMPS: gl.constexpr = gl.constexpr(3)  # [tagged, ns waited, tiles prefetched] per (SM, layer)


@constexpr_function
def _prefetch_asm(nbytes):
    return ("{\n\t.reg .pred p;\n\t.reg .u32 l;\n\tmov.u32 l, %laneid;\n\tsetp.eq.u32 p, l, 0;\n\t"
            f"@p cp.async.bulk.prefetch.L2.global [$1], {nbytes};\n\tmov.u32 $0, 0;\n\t}}")


@gluon.jit
def l2_prefetch(ptr, NBYTES: gl.constexpr):
    """Lane 0 of the warp asks L2 for the NBYTES bytes at ``ptr`` (a scalar; 16-byte aligned, NBYTES a multiple of
    16): an asynchronous hint that nothing waits for."""
    gl.inline_asm_elementwise(_prefetch_asm(NBYTES), "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait_prefetching(routed_ptr, index, tag, queue, i, n, tiles, BUDGET: gl.constexpr, TILE: gl.constexpr):
    """Poll routing entry ``index`` until it carries ``tag``; while it does not, prefetch into L2 the tiles of
    instructions i + 1 .. n - 1 of this CTA's queue (``queue`` = (its words' pointer, its first word's row, the word
    offsets of ring.py's layout)) that are not expert spans, in the ring's order, at most BUDGET tiles of TILE
    elements of ``tiles`` (module doc). Returns (the expert, the tiles prefetched)."""
    words_ptr, row, offs = queue
    v = gl.load(routed_ptr + index, volatile=True)
    sent = 0
    if (v >> ROUTE_BITS) != tag:
        j = i + 1  # the next queue entry the scan reads
        q = 0  # the scanned instruction's next tile, of nq: row tile q // nk, column tile k0 + q % nk
        nq = 0
        nk = 1
        first = 0  # its tile (0, k0)
        kt = 0
        while (v >> ROUTE_BITS) != tag:
            if (q < nq) & (sent < BUDGET):
                tile = first + (q // nk) * kt + q % nk
                l2_prefetch(tiles + tile.to(gl.int64) * TILE, TILE * tiles.dtype.element_ty.primitive_bitwidth // 8)
                sent += 1
                q += 1
            elif (j < n) & (sent < BUDGET):
                ins = Ins(gl.load(words_ptr + (row + j) * NWORDS + offs, mask=offs < NWORDS, other=0), offs)
                k0 = ins.field(W_K0)
                nk = gl.maximum(ins.field(W_K1) - k0, 1)
                kt = ins.field(W_KT)
                first = ins.field(W_T0) + k0
                # an expert span waits on its router; an empty column range streams nothing
                skip = ((ins.field(W_FLAGS) & EXPERT_SPAN) != 0) | (ins.field(W_K1) <= k0)
                nq = gl.where(skip, 0, ins.field(W_NR) * nk)
                q = 0
                j += 1
            v = gl.load(routed_ptr + index, volatile=True)
    return v & NO_EXPERT, sent


@gluon.jit
def first_wait(routed_ptr, index, tag, queue, i, n, tiles, waits, C: gl.constexpr):
    """A layer's first routing wait (``waits``: the trace [num_sms * NL, WAIT_STAMPS] and this wait's row in it):
    prefetching (C.PREFETCH tiles at most) and traced where the plan says so. Returns the expert."""
    TILE: gl.constexpr = C.TR * C.TK
    if C.TRACE:  # the low 32 bits of the first stamp: a wait's length wraps only past 2 s, and one register
        # across the wait, not two, keeps the loader within its 48
        t_first = globaltimer().to(gl.int32)
    if C.PREFETCH > 0:
        e, sent = wait_prefetching(routed_ptr, index, tag, queue, i, n, tiles, C.PREFETCH, TILE)
    else:
        e = routed_wait(routed_ptr, index, tag)
        sent = 0
    if C.TRACE:
        t_tagged = globaltimer()
        at = waits[0] + waits[1] * WAIT_STAMPS  # computed here, not held across the wait
        gl.store(at, t_tagged)
        gl.store(at + 1, (t_tagged.to(gl.int32) - t_first).to(gl.int64))
        gl.store(at + 2, gl.to_tensor(sent).to(gl.int64))
    return e
