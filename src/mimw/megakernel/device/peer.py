"""Tensor parallelism on the GPU: a rank's partials into every rank's inbox, and the peer counters' signals and
waits (docs/megakernel.md, "Tensor parallelism"; peers.py is the VM's stand-in and the layout's reference).

Rank r of ``C.TP`` runs its own persistent kernel. Its inboxes are one fp32 buffer that every rank can store into
(symmetric memory across GPUs; plain device memory where the ranks share one GPU: launch/tp.py), the three inboxes
one after the other (peers.inbox_views):
    O_SUM [TP, M, D]    DOWN_SUM [TP, M, D]    LM_GATHER [TP, M, V / TP]        (slot [src]: rank src's partial)
The kernel takes the addresses of every rank's inbox buffer and of every rank's counter table ([TP] int64 each,
``Bufs.pbox`` / ``Bufs.pcnt``) and its own rank (``Bufs.prank``, in memory). A PEER-flagged instruction (isa.PEER:
O_PROJ, DOWN_PROJ, LM_HEAD) stores its rows' partial into slot [rank] of every rank's inbox (``send``) and adds 1 to the
rows' peer counter in every rank's table (``signal``: a partition barrier, then one thread's release add at system
scope, so that the stores reach a peer GPU before the count does); a REDUCE polls its own table's peer counter with
system-scope acquire loads (sync.counter_wait's ``SYS``) and reads its own inbox through L2 (where a peer GPU's
stores land). Every other counter stays local, signalled and waited for at GPU scope as on one GPU (a system-scope
release is also a GPU-scope one: the local waits on the counters a REDUCE signals need no more).
Counters stay step-numbered (isa.py): a peer counter gets TP signals a step, its target ``(epoch + 1) * TP``.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function

from .. import peers
from . import layouts, matvec as mv, matvec_mt as mt

# the inboxes (peers.py) as the kernel's constexprs
O_BOX: gl.constexpr = gl.constexpr(peers.O_SUM)
DOWN_BOX: gl.constexpr = gl.constexpr(peers.DOWN_SUM)
LM_BOX: gl.constexpr = gl.constexpr(peers.LM_GATHER)


@constexpr_function
def box_offset(kind, C):
    """Element offset of inbox ``kind`` (peers.O_SUM, DOWN_SUM, LM_GATHER) in a rank's buffer (peers.inbox_views:
    O_SUM's [TP, M, D], then DOWN_SUM's, then LM_GATHER's)."""
    return int(kind) * C.TP * C.M * C.D


@constexpr_function
def box_width(kind, C):
    """Row width of inbox ``kind``: D, or the rank's V / TP vocabulary rows (C.V is the shard's)."""
    return C.V if int(kind) == peers.LM_GATHER else C.D


@gluon.jit
def _ptr(table, q, dtype: gl.constexpr):
    """Entry ``q`` of an address table as a pointer to ``dtype``."""
    return gl.load(table + q).to(gl.pointer_type(dtype), bitcast=True)


@gluon.jit
def send(b, kind: gl.constexpr, t, rows, val, mask, C: gl.constexpr):
    """Store ``val`` (token ``t``'s elements ``rows`` of this rank's partial, any layout they broadcast in) into
    slot [rank] of inbox ``kind`` of every rank."""
    OFF: gl.constexpr = box_offset(kind, C)
    W: gl.constexpr = box_width(kind, C)
    o = OFF + (gl.load(b.prank) * C.M + t) * W + rows
    TP: gl.constexpr = C.TP
    for q in gl.static_range(TP):
        gl.store(_ptr(b.pbox, q, gl.float32) + o, val, mask=mask)


@gluon.jit
def signal(b, index, C: gl.constexpr):
    """Publish this partition's stores to every rank: barrier, then one release add (system scope) of 1 on counter
    ``index`` of every rank's table."""
    gl.thread_barrier()
    TP: gl.constexpr = C.TP
    for q in range(TP):
        gl.atomic_add(_ptr(b.pcnt, q, gl.int32) + index, 1, sem="release", scope="sys")


@gluon.jit
def matvec_rows(sm, it, k0, k1, row0, n_tiles, b, kind: gl.constexpr, C: gl.constexpr):
    """O_PROJ / DOWN_PROJ / LM_HEAD of a rank, one token: each row tile's W[rows] . h over column tiles [k0, k1)
    goes to inbox ``kind`` of every rank (no residual: the REDUCE adds it). Returns it."""
    offs_r = gl.arange(0, C.TR, gl.SliceLayout(1, layouts.tile(C)))
    for r in range(n_tiles):
        acc, it = mv.dot_tile(sm, it, k0, k1, C)
        send(b, kind, 0, row0 + r * C.TR + offs_r, acc, offs_r >= 0, C)
    return it


@gluon.jit
def matvec_rows_mt(sm, it, k0, k1, base, row0, n_tiles, b, kind: gl.constexpr, C: gl.constexpr):
    """``matvec_rows`` for every token of a multi-token step (column tile k staged at chunk 8 (k - base))."""
    for r in range(n_tiles):
        rows, t = mt.tile_index(row0 + r * C.TR, C)
        acc, it = mt.dot_tile(sm, it, k0, k1, base, C)
        send(b, kind, t, rows, acc, (t < C.M) & (rows >= 0), C)
    return it
