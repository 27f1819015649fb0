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
layer boundaries, bounded only by the ring, the in-flight cap and the release hold:
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

from .context import HOLD_ARRIVE, HOLD_WAIT, NWORDS, W_FLAGS, W_K0, W_K1, W_KT, W_NR, W_T0


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
def loader(prog, desc, bufs, empty, ready, rel, C: gl.constexpr):
    """The loader role: walk this CTA's queue (``prog`` = (words, lengths, max_len)) and stream every instruction's
    weight tiles (isa.TileSpan in its words) into the ring, row tile by row tile, column tiles K0..K1 of each."""
    INFLIGHT: gl.constexpr = C.INFLIGHT
    QUIET: gl.constexpr = C.QUIET
    words_ptr, lens_ptr, MAXLEN = prog
    WP2: gl.constexpr = 16
    offs = gl.arange(0, WP2, gl.BlockedLayout([1], [32], [1], [0]))
    pid = gl.program_id(0)
    n = gl.load(lens_ptr + pid)
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
