"""The shared-memory ring between the loader and compute roles, and the loader's walk over the weight tiles.

``NB`` slots, each guarded by two mbarriers: ``ready[i]`` (the loader's TMA bytes have landed) and ``empty[i]`` (the
consumers are done reading). Producer and consumer walk the same tile sequence and keep one running tile counter
``it``: slot = it % NB, phase = (it // NB) & 1. A freshly initialised mbarrier counts as having completed the phase
before phase 0, so the producer's first pass waits ``empty`` with phase 1 and returns at once; the consumer waits
``ready`` with phase 0. The TMA engine itself arrives on ``ready`` with the transaction byte count set by
``mbarrier.expect`` (arrive.expect_tx), so completion means the bytes are in shared memory, not merely issued.
``consumer_release`` is a single-thread arrive: Gluon's barrier-insertion pass places a partition barrier before it,
so all consumer warps have finished reading the slot.

The loader is one warp with a small register budget: it only computes tile numbers and issues TMA. It never waits
on a dependency counter (weights do not depend on this step's activations), so it runs ahead across instruction and
layer boundaries, bounded only by the ring, the in-flight cap, the release hold and the routing of MoE layers:
  * expert spans (isa.EXPERT_SPAN: EXPERT_IN, EXPERT_DOWN): which expert's tiles a routing slot streams is known
    once the layer's ROUTER finisher has stored the slot's routing entry (isa.route_entry). The loader polls that
    one entry (sync.routed_wait) until it carries this step's tag (isa.route_tag of the epoch, read at the start:
    compute waits for that read before the launch's end can move the epoch on), then streams expert e's tiles
    ``T0 + e * XS + r * KT + k``; an unused slot (NO_EXPERT) streams nothing, and compute, reading the same entry
    after its dependency wait, consumes nothing. This is the one place the loader waits on step data. It cannot
    deadlock: the program places every queue's instructions stage by stage (program.py), so each of layer l's
    ROUTER parts, and everything they wait for, precede every expert instruction of layer l in every queue
    (``program.loader_wait_errors`` checks it for every program); a loader waiting on layer l's entry has streamed
    its own router tiles, and every other loader reaches its router tiles having waited only on earlier layers'
    entries, which by the same argument are stored. While it waits, the tiles already requested (the router's,
    earlier experts') keep landing, and the ring takes nothing new: the next layer's attention tiles come after the
    experts'. A layer's first wait is traced where the plan says so (device/route_wait.py);
  * in-flight cap (``INFLIGHT``): tile ``it`` is requested only once tile ``it - INFLIGHT`` has landed; fewer
    requests queued in the memory system shorten every round trip the step's hops make;
  * release hold (``QUIET``, hold.py's marks): a marked instruction's tiles past its first ``QUIET`` wait for the
    phase of the SM's last announced release on the one-count mbarrier ``rel``, so that release's fence does not
    wait behind a ring full of requests. The phase is named by its parity: the loader counts the announced releases
    it walks past.

Past K/V (every one-token attention split: a one-token step's, and a multi-token step's one-token groups', each over
its segment's context, block table row and first written position, read from the step: device/kv_stream.py; a
query block of several tokens keeps its own stages, ops/attn_query_block.py): an ATTN_PARTIAL instruction has no
weight tiles, but its split's past K/V does not depend on the step's activations either (the contexts, first
positions and block tables are step inputs, the rows before a segment's first written position were written by
earlier launches), so the loader streams it like weights: slot by slot, each slot KVS
positions of K then V, ``2 * KVS / KVBOX`` TMA boxes of one page of one KV head (descriptors over the pools viewed
as [rows, HD], box [KVBOX, HD], no swizzle) arriving on the slot's ``ready`` barrier with the slot's byte count.
The block-table gather (one vector load of the slot's boxes' pages) is issued one slot ahead, so its round trip
overlaps the previous slot's waits. Over an fp8 cache the rows' bf16 scales come with them: the loader's lanes
copy them with cp.async into the slot's entry of the scale buffer ``sbuf`` beside the ring and arrive on the same
barrier once their copies land (``cp.async.mbarrier.arrive``, which raises the pending count as it is issued, so
the phase completes only after the scales and the TMA bytes: the boxes' scales are runs of 32 bytes, too small and
too scattered for TMA's 128-byte aligned destinations). K/V slots take the in-flight cap like tiles, never the
release hold (the host's marks count weight tiles only: hold.py), and wait on nothing else: no new wait on step
data, so the deadlock argument is unchanged.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from . import layouts
from .context import (EXPERT_SPAN, HOLD_ARRIVE, HOLD_WAIT, NO_EXPERT, NWORDS, OP_ATTN_PARTIAL, PACK_SHIFT, SLOT_WORD,
                      W_A, W_B, W_C, W_D, W_FLAGS, W_K0, W_K1, W_KT, W_LAYER, W_NR, W_OP, W_T0, XS_WORD)
from .kv_stream import segment_slots, split_slots
from .route_wait import first_wait
from .sync import route_tag, routed_wait


@gluon.jit
def ring_init(empty, ready, NB: gl.constexpr):
    """Initialise NB empty/ready mbarrier pairs (one arrival each: the consumer's release, the TMA's completion)."""
    for i in gl.static_range(NB):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)


@gluon.jit
def _claim(empty, ready, it, NB: gl.constexpr, INFLIGHT: gl.constexpr, rel, hold_at, parity):
    """Slot it % NB once it may be filled: tile ``hold_at`` first waits for phase ``parity`` of ``rel``, then tile
    it - INFLIGHT must have landed and the slot must be free."""
    idx = it % NB
    if it == hold_at:
        mbarrier.wait(rel.index(0), parity)
    if INFLIGHT > 0:
        if it >= INFLIGHT:  # tile it - INFLIGHT's slot is not reissued before it - INFLIGHT + NB > it: its parity holds
            j = it - INFLIGHT
            mbarrier.wait(ready.index(j % NB), (j // NB) & 1)
    mbarrier.wait(empty.index(idx), ((it // NB) & 1) ^ 1)
    return idx


@gluon.jit
def _load(desc, tile, bufs, empty, ready, it, INFLIGHT: gl.constexpr, rel, hold_at, parity):
    """Wait for slot it % NB to be free, then TMA tile number ``tile`` (rows [tile * BR, +BR) of ``desc``, the tile
    array's [*, 32] view) into it; returns it + 1. Tile ``hold_at`` first waits for phase ``parity`` of ``rel``."""
    NB: gl.constexpr = bufs.type.shape[0]
    BR: gl.constexpr = desc.block_type.shape[0]
    idx = _claim(empty, ready, it, NB, INFLIGHT, rel, hold_at, parity)
    mbarrier.expect(ready.index(idx), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [tile * BR, 0], ready.index(idx), bufs.index(idx))
    return it + 1


@gluon.jit
def _field(w, offs, k: gl.constexpr):
    return gl.sum(gl.where(offs == k, w, 0), axis=0)


@gluon.jit
def _boxes(bt_row, layer, kvh, num_pages, p, last, C: gl.constexpr):
    """The pool box numbers [KVS / KVBOX] of boxes starting at positions ``p`` (clamped to ``last``, the last box
    holding a past position): box b's rows are [b * KVBOX, +KVBOX) of the pools viewed as [rows, HD]. One vector
    gather from the block table row ``bt_row``."""
    p = gl.maximum(gl.minimum(p, last), 0)  # an empty split (no past) reads position 0's page, never used
    page = gl.load(bt_row + p // C.PS)
    return ((layer * num_pages + page) * C.HKV + kvh) * (C.PS // C.KVBOX) + (p % C.PS) // C.KVBOX


@gluon.jit
def _stream_split(w, offs, kv, bufs, sbuf, empty, ready, rel, it, C: gl.constexpr):
    """An ATTN_PARTIAL instruction's past K/V (module doc, device/kv_stream.py): its split's slots, in order; returns
    the running tile counter past them. ``kv`` = (K and V pool descriptors, their scales, the block tables, their
    width, the context, the page count)."""
    kdesc, vdesc, ksc, vsc, bt, maxp, ctx, num_pages = kv
    NB: gl.constexpr = bufs.type.shape[0]
    NBOX: gl.constexpr = C.KVS // C.KVBOX
    SL: gl.constexpr = layouts.kv_scales(C)  # [NBOX, KVBOX]
    layer = _field(w, offs, W_LAYER)
    kvh = _field(w, offs, W_A)
    if C.M > 1:  # a one-token segment of a multi-token step: its own context, block table row and first position
        # written in this step (step inputs: ``ctx`` = (seg_ctx, seg_new)); the ring holds its past before that
        seg = _field(w, offs, W_B) & ((1 << PACK_SHIFT) - 1)
        ctxs, news = ctx
        lo, hi, hp, a0, n = segment_slots(_field(w, offs, W_C), _field(w, offs, W_D), gl.load(ctxs + seg),
                                          gl.load(news + seg), C.KVS, C.KVBOX)
        bt_row = bt + seg * maxp
    else:
        lo, hi, hp, a0, n = split_slots(_field(w, offs, W_C), _field(w, offs, W_D), ctx, C.KVS, C.KVBOX)
        bt_row = bt + _field(w, offs, W_B) * maxp
    last = ((hp - 1) // C.KVBOX) * C.KVBOX
    box = gl.arange(0, NBOX, gl.SliceLayout(1, SL))
    col = gl.expand_dims(gl.arange(0, C.KVBOX, gl.SliceLayout(0, SL)), 0)
    nxt = _boxes(bt_row, layer, kvh, num_pages, a0 + box * C.KVBOX, last, C)
    for j in range(n):
        rows = nxt  # this slot's boxes; the next slot's gather is in flight while this one waits and issues
        nxt = _boxes(bt_row, layer, kvh, num_pages, a0 + (j + 1) * C.KVS + box * C.KVBOX, last, C)
        idx = _claim(empty, ready, it, NB, C.INFLIGHT, rel, -1, 0)
        if C.FP8:  # the scales: KVBOX contiguous bf16 a box, at the box's row index in the scale pools
            at = gl.expand_dims(rows * C.KVBOX, 1) + col
            async_copy.async_copy_global_to_shared(sbuf.index(idx).slice(0, NBOX), ksc + at)
            async_copy.async_copy_global_to_shared(sbuf.index(idx).slice(NBOX, NBOX), vsc + at)
            async_copy.mbarrier_arrive(ready.index(idx), increment_count=True)
        mbarrier.expect(ready.index(idx), 2 * C.KVS * C.HD * kdesc.dtype.primitive_bitwidth // 8)
        slot = bufs.index(idx)._reinterpret(kdesc.dtype, [2 * NBOX, C.KVBOX, C.HD], kdesc.layout)
        for b in gl.static_range(NBOX):
            r = _field(rows, box, b) * C.KVBOX
            tma.async_copy_global_to_shared(kdesc, [r, 0], ready.index(idx), slot.index(b))
            tma.async_copy_global_to_shared(vdesc, [r, 0], ready.index(idx), slot.index(NBOX + b))
        it += 1
    return it


@gluon.jit
def loader(prog, moe, kv, desc, bufs, sbuf, empty, ready, rel, ep_bar, C: gl.constexpr):
    """The loader role: walk this CTA's queue (``prog`` = (words, lengths, max_len)) and stream every instruction's
    weight tiles (isa.TileSpan in its words) into the ring, row tile by row tile, column tiles K0..K1 of each; an
    expert span once its routing entry names the expert (``moe`` = (counters, their number, the routing table, the
    routing-wait trace)), a layer's first wait traced where the plan says so (device/route_wait.py);
    every one-token attention split's past K/V (``kv``: ``_stream_split``; module doc). With MoE layers
    (C.S > 0) it reads the step's epoch first and then arrives on ``ep_bar``, which compute waits for before the
    launch's last act moves the epoch on."""
    INFLIGHT: gl.constexpr = C.INFLIGHT
    QUIET: gl.constexpr = C.QUIET
    words_ptr, lens_ptr, MAXLEN = prog
    cnt_ptr, NCNT, routed_ptr, waits = moe
    WP2: gl.constexpr = 16
    offs = gl.arange(0, WP2, gl.BlockedLayout([1], [32], [1], [0]))
    pid = gl.program_id(0)
    n = gl.load(lens_ptr + pid)
    kdesc, vdesc, ksc, vsc, bt, maxp, ctx_ptr, num_pages = kv
    if C.M == 1:  # the step's context (a one-token step's one segment): where every split's past ends
        kv = (kdesc, vdesc, ksc, vsc, bt, maxp, gl.load(ctx_ptr), num_pages)
    tag = 0
    if C.S > 0:
        # (NCNT + 1) first: an address spelled as compute's is hoisted above the roles' split, one copy for both,
        # and then has to be carried into the loader's 48 registers (ptxas spilled it)
        tag = route_tag(gl.load(cnt_ptr + (NCNT + 1), cache_modifier=".cg"))
        mbarrier.arrive(ep_bar.index(0), count=1)
    released = 0  # releases compute announced (hold.py marks) that this walk has passed: the hold's phase count
    waited = -1  # the last layer whose first expert span this walk has passed (its routing wait: route_wait.py)
    it = 0
    for i in range(n):
        w = gl.load(words_ptr + (pid * MAXLEN + i) * NWORDS + offs, mask=offs < NWORDS, other=0)
        nr = _field(w, offs, W_NR)
        flags = _field(w, offs, W_FLAGS)
        if nr > 0:
            t0 = _field(w, offs, W_T0)
            if C.S > 0:  # (the span's other fields are decoded past the wait: fewer registers held across it)
                if (flags & EXPERT_SPAN) != 0:  # the one wait on step data: the expert this slot holds
                    layer = _field(w, offs, W_LAYER)
                    entry = layer * C.S + _field(w, offs, SLOT_WORD)
                    if layer != waited:  # the layer's first: the router is likely still running
                        waited = layer
                        e = first_wait(routed_ptr, entry, tag, (waits, pid * C.NL + layer), C)
                    else:  # the finisher stored this entry with the first's: at most a short spin
                        e = routed_wait(routed_ptr, entry, tag)
                    if e == NO_EXPERT:
                        nr = 0
                    else:
                        t0 = t0 + e * _field(w, offs, XS_WORD)
            k0 = _field(w, offs, W_K0)
            k1 = _field(w, offs, W_K1)
            kt = _field(w, offs, W_KT)
            hold_at = -1
            if QUIET >= 0:
                if (flags & HOLD_WAIT) != 0:
                    hold_at = it + QUIET
            parity = (released - 1) & 1
            for r in range(nr):
                for k in range(k0, k1):
                    it = _load(desc, t0 + r * kt + k, bufs, empty, ready, it, INFLIGHT, rel, hold_at, parity)
        if C.KVS > 0:
            if C.QT > 1:  # a query block of several tokens keeps its own stages (ops/attn_query_block.py)
                if (_field(w, offs, W_OP) == OP_ATTN_PARTIAL) & ((_field(w, offs, W_B) >> PACK_SHIFT) == 0):
                    it = _stream_split(w, offs, kv, bufs, sbuf, empty, ready, rel, it, C)
            else:
                if _field(w, offs, W_OP) == OP_ATTN_PARTIAL:
                    it = _stream_split(w, offs, kv, bufs, sbuf, empty, ready, rel, it, C)
        if QUIET >= 0:
            if (flags & HOLD_ARRIVE) != 0:
                released += 1


@gluon.jit
def consumer_acquire(bufs, ready, it, layout: gl.constexpr):
    """Compute: wait for tile ``it`` and read it into registers with ``layout``. Returns (tile, slot index)."""
    NB: gl.constexpr = bufs.type.shape[0]
    idx = it % NB
    mbarrier.wait(ready.index(idx), (it // NB) & 1)
    return bufs.index(idx).load(layout), idx


@gluon.jit
def consumer_release(empty, idx):
    """Compute: hand slot ``idx`` back to the loader (after every consumer warp has read it; see module doc)."""
    mbarrier.arrive(empty.index(idx), count=1)
