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
    earlier experts') keep landing; the next layer's attention tiles wait behind it;
  * in-flight cap (``INFLIGHT``): tile ``it`` is requested only once tile ``it - INFLIGHT`` has landed; fewer
    requests queued in the memory system shorten every round trip the step's hops make;
  * release hold (``QUIET``, hold.py's marks): a marked instruction's tiles past its first ``QUIET`` wait for the
    phase of the SM's last announced release on the one-count mbarrier ``rel``, so that release's fence does not
    wait behind a ring full of requests. The phase is named by its parity: the loader counts the announced releases
    it walks past.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .context import (EXPERT_SPAN, HOLD_ARRIVE, HOLD_WAIT, NO_EXPERT, NWORDS, SLOT_WORD, W_FLAGS, W_K0, W_K1, W_KT,
                      W_LAYER, W_NR, W_T0, XS_WORD)
from .sync import route_tag, routed_wait


@gluon.jit
def ring_init(empty, ready, NB: gl.constexpr):
    """Initialise NB empty/ready mbarrier pairs (one arrival each: the consumer's release, the TMA's completion)."""
    for i in gl.static_range(NB):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)


@gluon.jit
def _load(desc, tile, bufs, empty, ready, it, INFLIGHT: gl.constexpr, rel, hold_at, parity):
    """Wait for slot it % NB to be free, then TMA tile number ``tile`` (rows [tile * BR, +BR) of ``desc``, the tile
    array's [*, 32] view) into it; returns it + 1. Tile ``hold_at`` first waits for phase ``parity`` of ``rel``."""
    NB: gl.constexpr = bufs.type.shape[0]
    BR: gl.constexpr = desc.block_type.shape[0]
    idx = it % NB
    if it == hold_at:
        mbarrier.wait(rel.index(0), parity)
    if INFLIGHT > 0:
        if it >= INFLIGHT:  # tile it - INFLIGHT's slot is not reissued before it - INFLIGHT + NB > it: its parity holds
            j = it - INFLIGHT
            mbarrier.wait(ready.index(j % NB), (j // NB) & 1)
    mbarrier.wait(empty.index(idx), ((it // NB) & 1) ^ 1)
    mbarrier.expect(ready.index(idx), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [tile * BR, 0], ready.index(idx), bufs.index(idx))
    return it + 1


@gluon.jit
def _field(w, offs, k: gl.constexpr):
    return gl.sum(gl.where(offs == k, w, 0), axis=0)


@gluon.jit
def loader(prog, moe, desc, bufs, empty, ready, rel, ep_bar, C: gl.constexpr):
    """The loader role: walk this CTA's queue (``prog`` = (words, lengths, max_len)) and stream every instruction's
    weight tiles (isa.TileSpan in its words) into the ring, row tile by row tile, column tiles K0..K1 of each; an
    expert span once its routing entry names the expert (``moe`` = (counters, their number, the routing table);
    module doc). With MoE layers (C.S > 0) it reads the step's epoch first and then arrives on ``ep_bar``, which
    compute waits for before the launch's last act moves the epoch on."""
    INFLIGHT: gl.constexpr = C.INFLIGHT
    QUIET: gl.constexpr = C.QUIET
    words_ptr, lens_ptr, MAXLEN = prog
    cnt_ptr, NCNT, routed_ptr = moe
    WP2: gl.constexpr = 16
    offs = gl.arange(0, WP2, gl.BlockedLayout([1], [32], [1], [0]))
    pid = gl.program_id(0)
    n = gl.load(lens_ptr + pid)
    tag = 0
    if C.S > 0:
        tag = route_tag(gl.load(cnt_ptr + NCNT + 1, cache_modifier=".cg"))
        mbarrier.arrive(ep_bar.index(0), count=1)
    released = 0  # releases compute announced (hold.py marks) that this walk has passed: the hold's phase count
    it = 0
    for i in range(n):
        w = gl.load(words_ptr + (pid * MAXLEN + i) * NWORDS + offs, mask=offs < NWORDS, other=0)
        nr = _field(w, offs, W_NR)
        hold_at = -1
        flags = _field(w, offs, W_FLAGS)
        if QUIET >= 0:
            if (flags & HOLD_WAIT) != 0:
                hold_at = it + QUIET
        parity = (released - 1) & 1
        if nr > 0:
            t0 = _field(w, offs, W_T0)
            k0 = _field(w, offs, W_K0)
            k1 = _field(w, offs, W_K1)
            kt = _field(w, offs, W_KT)
            if C.S > 0:
                if (flags & EXPERT_SPAN) != 0:  # the one wait on step data: the expert this slot holds
                    e = routed_wait(routed_ptr, _field(w, offs, W_LAYER) * C.S + _field(w, offs, SLOT_WORD), tag)
                    if e == NO_EXPERT:
                        nr = 0
                    else:
                        t0 = t0 + e * _field(w, offs, XS_WORD)
            for r in range(nr):
                for k in range(k0, k1):
                    it = _load(desc, t0 + r * kt + k, bufs, empty, ready, it, INFLIGHT, rel, hold_at, parity)
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
