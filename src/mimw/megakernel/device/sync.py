"""Cross-CTA dependencies of the megakernel: step-numbered counters, tickets, and the timer traces read.

Counters are int32 words in global memory. ``counter_signal``: a partition barrier (every thread's stores of this
instruction precede it), then one thread's ``atom.add.release.gpu``. ``counter_wait``: poll with
``atom.add(0).acquire.gpu`` until the counter reaches the target; Triton broadcasts the value through shared memory
(a CTA barrier), so every thread's later loads are ordered after the acquire. Loads of data produced by other CTAs
use ``cache_modifier=".cg"`` (L2, bypassing the non-coherent L1) because scratch addresses are reused across
layers and a stale L1 line from an earlier layer must never be read. Targets are step-numbered: in step ``epoch`` a
counter that receives ``count`` signals per step is complete at ``(epoch + 1) * count``, so counters are never reset
between steps (isa.py).

Inside the compute partition, ``gl.thread_barrier`` (and the barrier Triton adds after ``cp.async.wait_group`` and
around a scalar atomic) becomes the partition's own barrier (``bar.sync 0, 32 * NW``) only in code inlined into the
kernel: Triton's warp-specialize lowering rewrites the kernel function's barriers, never a noinline function's, whose
barriers stay CTA-wide (``bar.sync 0``: every thread of the CTA, the loader's warps included, which never arrive: a
deadlock). A noinline function of the compute partition therefore syncs with ``partition_barrier`` and waits for
its copies with ``copies_landed``, and leaves counter waits and tickets to its caller.

Routing entries (isa.py, MoE): ``route_tag`` is isa.route_tag on the device; ``routed_wait`` is the loader's poll of
one entry until it carries this step's tag (volatile loads: re-read from memory each time; the loader only turns
the entry into tile numbers of weights no one writes, so it needs no acquire); ``routed_read`` is compute's read of
an entry its dependency wait already ordered after the router's store (L2, not the non-coherent L1).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function

from .context import NO_EXPERT, ROUTE_BITS, ROUTE_TAG_MASK, ROUTE_TAG_SET


@gluon.jit
def counter_wait(cnt_ptr, index, target, SYS: gl.constexpr = False):
    """Spin until counter ``index`` has reached ``target`` (acquire, gpu scope; ``SYS``: system scope, a
    tensor-parallel REDUCE's: device/peer.py). Compared as ``v - target < 0`` in wrapping int32 arithmetic:
    step-numbered targets pass 2**31 after a few million steps, and a plain ``v < target`` would then let every
    wait through at once."""
    if SYS:
        v = gl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="sys")
        while v - target < 0:
            v = gl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="sys")
    else:
        v = gl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="gpu")
        while v - target < 0:
            v = gl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="gpu")


@gluon.jit
def counter_signal(cnt_ptr, index):
    """Publish this partition's stores: barrier, then one release add of 1 on counter ``index``."""
    gl.thread_barrier()
    gl.atomic_add(cnt_ptr + index, 1, sem="release", scope="gpu")


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


@constexpr_function
def _barrier_asm(NW):
    return f"bar.sync 0, {32 * NW};\n\tmov.u32 $0, $1;"


@constexpr_function
def _wait_asm(N):
    return f"cp.async.wait_group {N};\n\tmov.u32 $0, $1;"


@gluon.jit
def partition_barrier(NW: gl.constexpr):
    """The compute partition's barrier (barrier 0, its NW warps' threads: what Triton lowers the partition's
    inlined barriers to), as inline PTX: the barrier of a noinline function the partition calls."""
    tid = gl.arange(0, 32 * NW, gl.BlockedLayout([1], [32], [NW], [0]))  # one element a thread: one bar.sync
    gl.inline_asm_elementwise(_barrier_asm(NW), "=r,r", [tid], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def copies_landed(N: gl.constexpr, NW: gl.constexpr):
    """``cp.async.wait_group N``: this thread's copies but its N most recent groups landed, with no barrier (Gluon's
    ``async_copy.wait_group`` adds one): a noinline function's wait for its own copies."""
    tid = gl.arange(0, 32 * NW, gl.BlockedLayout([1], [32], [NW], [0]))
    gl.inline_asm_elementwise(_wait_asm(N), "=r,r", [tid], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def globaltimer():
    """%globaltimer (ns, comparable across SMs) as a scalar, for traces (a reduction over the partition)."""
    offs = gl.arange(0, 32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [offs], dtype=gl.int64, is_pure=False,
                                  pack=1)
    return gl.max(t, axis=0)


@gluon.jit
def route_tag(epoch):
    """isa.route_tag: the tag of step ``epoch``'s routing entries."""
    return (epoch & ROUTE_TAG_MASK) | ROUTE_TAG_SET


@gluon.jit
def route_entry(expert, epoch):
    """isa.route_entry: the entry step ``epoch`` stores for ``expert`` (NO_EXPERT: an unused slot)."""
    return (route_tag(epoch) << ROUTE_BITS) | expert


@gluon.jit
def routed_wait(routed_ptr, index, tag):
    """The loader: spin on routing entry ``index`` until it carries ``tag``; returns its expert (or NO_EXPERT)."""
    v = gl.load(routed_ptr + index, volatile=True)
    while (v >> ROUTE_BITS) != tag:
        v = gl.load(routed_ptr + index, volatile=True)
    return v & NO_EXPERT


@gluon.jit
def routed_read(routed_ptr, index):
    """Compute, after its dependency wait: the expert of routing entry ``index`` (or NO_EXPERT)."""
    return gl.load(routed_ptr + index, cache_modifier=".cg") & NO_EXPERT
