"""MIMW orchestration building blocks for Gluon kernels on Hopper: the shared-memory ring, role wiring, and global
dependency counters. Every megakernel instruction (and the standalone GEMV in ``gemv.py``) is built from these.

The ring
    ``NB`` shared-memory slots, each guarded by two mbarriers: ``ready[i]`` (the loader's TMA bytes have landed)
    and ``empty[i]`` (the consumers are done reading).  Producer and consumer walk the same tile sequence and keep
    one running tile counter ``it``: slot = it % NB, phase = (it // NB) & 1.  A freshly initialised mbarrier counts
    as having completed the phase before phase 0, so the producer's first pass waits ``empty`` with phase 1 and
    returns at once; the consumer waits ``ready`` with phase 0.  The TMA engine itself arrives on ``ready`` with the
    transaction byte count set by ``mbarrier.expect`` (arrive.expect_tx), so completion means the bytes are in
    shared memory, not merely issued.  ``consumer_release`` is a single-thread arrive: Gluon's barrier-insertion pass
    places a partition-local ``bar.sync`` before it, so all consumer warps have finished reading the slot.

Roles
    ``gl.warp_specialize`` runs the default partition (compute, ``num_warps`` warps) beside worker partitions.
    The loader is one warp with a small register budget: it only computes addresses and issues TMA.  It NEVER
    waits on a dependency counter — weights (and past KV) do not depend on this step's activations — so it runs
    ahead across instruction and layer boundaries, bounded only by the ring depth.

The release hold (``KernelConfig.quiet``, the default since session 17)
    A counter's release (``counter_signal``) is a ``MEMBAR.GPU`` that waits until this CTA's memory traffic is
    acknowledged, and under the weight stream that is as long as the tiles the loader requested last take to land.
    With a hold, compute arrives on a one-count mbarrier after each release of a streaming instruction, and the
    loader, starting a streaming instruction of a new stage, requests only its first ``quiet`` tiles before the
    phase of the previous release has completed (``producer_load``'s ``hold``): the release then meets fewer
    tiles in flight.
    The phase is named by its parity only: while compute is two or more releases behind, the parity also names an
    older phase and the loader may pass early. That loses only the hold (the ring's barriers still order every
    tile), never liveness: compute reaches the release the loader waits for with tiles already requested.

Counters (cross-CTA dependencies)
    int32 words in global memory.  ``counter_signal``: a partition barrier (every thread's stores of this
    instruction precede it), then one thread's ``atom.add.release.gpu``.  ``counter_wait``: one thread polls with
    ``atom.add(0).acquire.gpu`` until the counter reaches the target; the value is broadcast to the partition
    through shared memory (a CTA barrier), so every thread's later loads are ordered after the acquire.  Loads of
    data produced by other CTAs use ``cache_modifier=".cg"`` (L2, bypassing the non-coherent L1) because scratch
    addresses are reused across layers and a stale L1 line from an earlier layer must never be read.
    Targets are step-numbered: in step ``epoch`` a counter that receives ``count`` signals per step is complete at
    ``(epoch + 1) * count``, so counters are never reset between steps.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def ring_init(empty, ready, NB: gl.constexpr):
    """Initialise NB empty/ready mbarrier pairs (one arrival each: the consumer's release, the TMA's completion)."""
    for i in gl.static_range(NB):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)


# Per-warp slot releases (KernelConfig.warp_release): the NB ``empty`` barriers live in the dynamic shared memory past
# Triton's own (Gluon gives no shared address of its allocations, so inline asm could not arrive on them), at
# %dynamic_smem_size - WOFF + 8 i (WOFF: the bytes from barrier 0 to the end of the dynamic shared memory, which
# holds the cluster exchange region after them, gpu/cluster.py). Each counts its phase in warps: every consumer
# warp's lane 0 arrives once the warp's own reads of the slot are done. Triton's single-thread release
# (``consumer_release``) needs a partition barrier before it: one of the two CTA barriers a tile loop has (the other
# comes with every ``mbarrier.wait`` in a multi-warp partition and stays; bench/NOTES.md session 18 §4).
@gluon.jit
def warp_ring_init(tid, NB: gl.constexpr, WOFF: gl.constexpr, NW: gl.constexpr):
    """Before ``gl.warp_specialize`` (``tid``: one element a thread of the partition running it): thread 0
    initialises the NB empty barriers for NW arrivals a phase; the specialisation's start orders it before the
    loader's first wait."""
    for i in gl.static_range(NB):
        gl.inline_asm_elementwise(
            "{ .reg .u32 a, g; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; "
            "mov.u32 g, global_smem; add.u32 a, a, g; setp.eq.u32 p, $1, 0; @p mbarrier.init.shared::cta.b64 [a], $3; "
            "mov.u32 $0, 0; }",
            "=r,r,r,r", [tid, tid * 0 + (WOFF - 8 * i), tid * 0 + NW], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def warp_release(idx, WOFF: gl.constexpr, NW: gl.constexpr):
    """Compute, after its reads of slot ``idx`` were issued: each warp synchronises its lanes (``bar.warp.sync``
    orders their shared-memory reads) and its lane 0 arrives on empty barrier ``idx`` (release: those reads are
    performed first). No partition barrier: the warps move on independently."""
    lane = gl.arange(0, 32 * NW, gl.BlockedLayout([1], [32], [NW], [0]))
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g, l; .reg .pred p; bar.warp.sync -1; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $1; "
        "mov.u32 g, global_smem; add.u32 a, a, g; add.u32 a, a, $2; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
        "@p mbarrier.arrive.release.cta.shared::cta.b64 _, [a]; mov.u32 $0, 0; }",
        "=r,r,r", [lane * 0 + WOFF, lane * 0 + idx * 8], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def warp_ring_wait(idx, parity, WOFF: gl.constexpr):
    """Loader (one warp): wait for the phase of parity ``parity`` of empty barrier ``idx`` (``warp_release``)."""
    lane = gl.arange(0, 32, gl.BlockedLayout([1], [32], [1], [0]))
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $1; mov.u32 g, global_smem; "
        "add.u32 a, a, g; add.u32 a, a, $2; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [a], $3; "
        "@!p bra WAIT; mov.u32 $0, 0; }",
        "=r,r,r,r", [lane * 0 + WOFF, lane * 0 + idx * 8, lane * 0 + parity], dtype=gl.int32, is_pure=False,
        pack=1)


@gluon.jit
def _thread0_hold_word(tid, HOFF: gl.constexpr, INSN: gl.constexpr):
    """Thread 0 of the partition running it (``tid``: one element a thread) applies ``INSN`` (PTX with the word's
    address in ``a``) to the release hold's count, a 32-bit word HOFF bytes before the end of the dynamic shared
    memory."""
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; mov.u32 g, global_smem; "
        "add.u32 a, a, g; setp.eq.u32 p, $1, 0; @p " + INSN.value + "; mov.u32 $0, 0; }",
        "=r,r,r", [tid, tid * 0 + HOFF], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def hold_count_init(tid, HOFF: gl.constexpr):
    """KernelConfig.hold_count, before ``gl.warp_specialize``: the count starts at 0; the specialisation's start
    orders it before either partition's first access."""
    _thread0_hold_word(tid, HOFF, "st.shared.u32 [a], 0")


@gluon.jit
def hold_count_add(tid, HOFF: gl.constexpr):
    """KernelConfig.hold_count, compute after a streaming release: thread 0 (whose release add and its fence
    precede this in program order) adds one with a shared-memory atomic. The count's only writer; the loader reads
    it atomically too (no plain access of the word races another: racecheck)."""
    _thread0_hold_word(tid, HOFF, "red.shared.add.u32 [a], 1")


@gluon.jit
def hold_count_wait(target, HOFF: gl.constexpr):
    """KernelConfig.hold_count, the loader (one warp): spin until compute's release count reaches ``target``. A
    count, not an mbarrier's phases: no phase goes unwaited and none can alias (KernelConfig.quiet)."""
    lane = gl.arange(0, 32, gl.BlockedLayout([1], [32], [1], [0]))
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g, c; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $1; mov.u32 g, global_smem; "
        "add.u32 a, a, g; SPIN: atom.shared.add.u32 c, [a], 0; setp.lt.s32 p, c, $2; @!p bra DONE; "
        "nanosleep.u32 32; bra SPIN; DONE: mov.u32 $0, 0; }",
        "=r,r,r", [lane * 0 + HOFF, lane * 0 + target], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _timer_lanes():
    """(%globaltimer per lane [32], lane index [32]); every warp of the partition holds all 32 lanes."""
    offs = gl.arange(0, 32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [offs], dtype=gl.int64, is_pure=False,
                                  pack=1)
    return t, offs


@gluon.jit
def globaltimer():
    """%globaltimer (ns, comparable across SMs) as a scalar, for traces (a reduction over the partition)."""
    t, _ = _timer_lanes()
    return gl.max(t, axis=0)


@gluon.jit
def globaltimer_after(dep):
    """``globaltimer`` read only once ``dep`` (an int32 scalar computed from the phase's results) exists: the timer
    read is predicated on it, so neither the compiler nor ptxas can issue it before the work that produced ``dep``
    (an unpredicated read may be scheduled ahead of the arithmetic it is meant to follow)."""
    offs = gl.arange(0, 32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    t = gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $1, -2147483647; @p mov.u64 $0, %globaltimer; @!p mov.u64 $0, 0; }",
        "=l,r", [offs * 0 + dep], dtype=gl.int64, is_pure=False, pack=1)
    return gl.max(t, axis=0)


# int64 stamps per instruction in a trace (trace.py): four for every op, four more for ATTN_PARTIAL
TRACE_STAMPS: gl.constexpr = gl.constexpr(8)


@gluon.jit
def stamp(ptr):
    """Store %globaltimer at ``ptr`` from lane 0 of each warp: no cross-warp reduction, so a per-tile stamp costs
    a timer read and a store."""
    t, offs = _timer_lanes()
    gl.store(ptr + offs * 0, t, mask=offs == 0)


@gluon.jit
def producer_load(desc, row, col, bufs, empty, ready, it, stamps=None, INFLIGHT: gl.constexpr = 0, hold=None,
                  hold_at=-1, hold_parity=0, deep=False, DEEP: gl.constexpr = 0, WOFF: gl.constexpr = 0,
                  HOFF: gl.constexpr = 0):
    """Loader: wait for slot it % NB to be free, then TMA the [rows, cols] box at (row, col) of ``desc`` into it.
    Returns it + 1. ``stamps`` (tile trace, trace.py): the loader's time before and after the wait for the slot go
    to ``stamps[4 it]`` and ``stamps[4 it + 1]``. ``INFLIGHT`` > 0 caps the tiles requested but not yet landed:
    tile it is issued only once tile it - INFLIGHT has landed (its ``ready`` phase; the slot of that tile is not
    reissued before tile it - INFLIGHT + NB > it, so the parity cannot have moved on). The ring still buffers NB
    landed tiles; only the requests queued in the memory system are bounded. ``hold`` (KernelConfig.quiet): tile
    ``hold_at`` waits for the phase of parity ``hold_parity`` of the mbarrier ``hold`` first (``release_hold``).
    ``DEEP`` > 0 (KernelConfig.inflight_deep): where ``deep`` holds, the cap is DEEP instead of INFLIGHT (DEEP < NB:
    tile it - DEEP's slot is not reissued before tile it - DEEP + NB > it either). ``WOFF`` > 0
    (KernelConfig.warp_release): the slot's empty barrier is ``warp_release``'s, not ``empty``. ``HOFF`` > 0
    (KernelConfig.hold_count): the hold waits for compute's release count to reach ``hold_parity`` instead
    (``hold_count_wait``)."""
    NB: gl.constexpr = bufs.type.shape[0]
    idx = it % NB
    ph = (it // NB) & 1
    if hold is not None:
        if it == hold_at:
            if HOFF > 0:
                hold_count_wait(hold_parity, HOFF)
            else:
                mbarrier.wait(hold.index(0), hold_parity)
    if INFLIGHT > 0:
        if DEEP > 0:
            cap = INFLIGHT + (DEEP - INFLIGHT) * deep.to(gl.int32)
            if it >= cap:
                j = it - cap
                mbarrier.wait(ready.index(j % NB), (j // NB) & 1)
        else:
            if it >= INFLIGHT:
                j = it - INFLIGHT
                mbarrier.wait(ready.index(j % NB), (j // NB) & 1)
    if stamps is not None:
        stamp(stamps + 4 * it)
    if WOFF > 0:
        warp_ring_wait(idx, ph ^ 1, WOFF)
    else:
        mbarrier.wait(empty.index(idx), ph ^ 1)
    if stamps is not None:
        stamp(stamps + 4 * it + 1)
    mbarrier.expect(ready.index(idx), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], ready.index(idx), bufs.index(idx))
    return it + 1


@gluon.jit
def producer_rows(desc, row0, n_row_tiles, k0, k1, bufs, empty, ready, it, TR: gl.constexpr, TK: gl.constexpr,
                  stamps=None, INFLIGHT: gl.constexpr = 0, hold=None, hold_at=-1, hold_parity=0, deep=False,
                  DEEP: gl.constexpr = 0, WOFF: gl.constexpr = 0, HOFF: gl.constexpr = 0):
    """Loader: stream rows [row0, row0 + n_row_tiles*TR) of ``desc``, row tile by row tile, column tiles [k0, k1)
    of each."""
    for r in range(n_row_tiles):
        for k in range(k0, k1):
            it = producer_load(desc, row0 + r * TR, k * TK, bufs, empty, ready, it, stamps, INFLIGHT, hold, hold_at,
                               hold_parity, deep, DEEP, WOFF, HOFF)
    return it


@gluon.jit
def producer_weight_rows(desc, K: gl.constexpr, row0, n_row_tiles, k0, k1, bufs, empty, ready, it,
                         TR: gl.constexpr, TK: gl.constexpr, TILED: gl.constexpr, stamps=None,
                         INFLIGHT: gl.constexpr = 0, hold=None, hold_at=-1, hold_parity=0, deep=False,
                         DEEP: gl.constexpr = 0, WOFF: gl.constexpr = 0, HOFF: gl.constexpr = 0):
    """``producer_rows`` over a [*, K] weight matrix. ``TILED``: the matrix is stored tile-major
    (``pack.tile_major``: tile (row tile R, column tile c) is the contiguous [TR, TK] block number R * KT + c of a
    [*, TK] matrix, which ``desc`` describes — or of the same bytes as a [*, 32] matrix, TR * TK / 32 rows a tile,
    for tensor-core consumption), so every TMA load reads 16 contiguous kilobytes; otherwise it is row-major and a
    tile is TR runs of TK elements, K apart."""
    if TILED:
        KT: gl.constexpr = (K + TK - 1) // TK
        BR: gl.constexpr = desc.block_type.shape[0]  # rows of one tile in desc's view: TR, or TR * TK / 32 folded
        for r in range(n_row_tiles):
            for k in range(k0, k1):
                it = producer_load(desc, ((row0 // TR + r) * KT + k) * BR, 0, bufs, empty, ready, it, stamps,
                                   INFLIGHT, hold, hold_at, hold_parity, deep, DEEP, WOFF, HOFF)
    else:
        it = producer_rows(desc, row0, n_row_tiles, k0, k1, bufs, empty, ready, it, TR, TK, stamps, INFLIGHT, hold,
                           hold_at, hold_parity, deep, DEEP, WOFF, HOFF)
    return it


@gluon.jit
def consumer_acquire(bufs, ready, it, layout: gl.constexpr, stamps=None):
    """Compute: wait for tile ``it`` and read it into registers with ``layout``. Returns (tile, slot index).
    ``stamps`` (tile trace): compute's time before and after the wait for the tile's bytes go to
    ``stamps[4 it + 2]`` and ``stamps[4 it + 3]``."""
    NB: gl.constexpr = bufs.type.shape[0]
    idx = it % NB
    if stamps is not None:
        stamp(stamps + 4 * it + 2)
    mbarrier.wait(ready.index(idx), (it // NB) & 1)
    if stamps is not None:
        stamp(stamps + 4 * it + 3)
    return bufs.index(idx).load(layout), idx


@gluon.jit
def consumer_release(empty, idx):
    """Compute: hand slot ``idx`` back to the loader (after every consumer warp has read it; see module doc)."""
    mbarrier.arrive(empty.index(idx), count=1)


@gluon.jit
def counter_wait(cnt_ptr, index, target):
    """Spin until counter ``index`` has reached ``target`` (acquire, gpu scope). Compared as ``v - target < 0`` in
    wrapping int32 arithmetic: step-numbered targets pass 2**31 after a few million steps, and a plain ``v < target``
    would then let every wait through at once."""
    v = gl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="gpu")
    while v - target < 0:
        v = gl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="gpu")


@gluon.jit
def ticket_is_last(cnt_ptr, ticket, count, epoch):
    """Draw a ticket (isa.py): after a partition barrier (every thread's partial stores precede it), one acq_rel
    add on counter ``ticket``; True for the part that brings it to (epoch + 1) * count, i.e. the last of ``count``
    parts this step. ``ticket < 0`` (a lone part, no ticket): True."""
    gl.thread_barrier()
    last = ticket < 0
    if ticket >= 0:
        drawn = gl.atomic_add(cnt_ptr + ticket, 1, sem="acq_rel", scope="gpu")
        last = drawn - ((epoch + 1) * count - 1) == 0
    return last


@gluon.jit
def counter_signal(cnt_ptr, index, n=1):
    """Publish this partition's stores: barrier, then one release add of ``n`` on counter ``index``."""
    gl.thread_barrier()
    gl.atomic_add(cnt_ptr + index, n, sem="release", scope="gpu")
