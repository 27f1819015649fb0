"""Past K/V in the ring: the slots an attention split's positions fill, described once for the loader that streams
them (device/ring.py) and the compute role that reads them (ops/attn_partial.py). Every split whose query is one
token streams so: a one-token step's, and in a multi-token step every one-token attention group's (a decode batch's
segments, a mixed step's single tokens), each over its own segment's context and block table row.

A split (``split_range``) covers past positions [lo, hp); position ``ctx - 1``, which ATTN_IN writes in this step,
is never among them (the last split reads it after its dependency wait, from the cache). Everything a slot needs
is known at launch: the context and the block table are step inputs, and past rows were written by earlier
launches. So the loader streams the split's slots as it streams weight tiles, ahead of compute across the
dependency wait and across instructions, and compute consumes them in order with the same running tile counter.

    slot j (j < n) holds positions [a0 + j*KVS, a0 + (j+1)*KVS),  a0 = lo rounded down to a box (KVBOX rows)
    as [2, KVS, HD] in the cache's element type: K's rows, then V's (plan.kv_ring: exactly the slot's bytes)
    box i of the slot: KVBOX rows of one page of one KV head, pool row ((layer*P + page)*HKV + kvh)*PS + p % PS
    with p its first position; a box past hp repeats the last box that holds a past position (every box lands,
    so the slot's byte count is a constant: ``mbarrier.expect`` takes a compile-time count)
    (fp8) the rows' bf16 scales, [2, KVS], in the slot's entry of the scale buffer beside the ring

A multi-token step's one-token segment may continue rows of its sequence that other segments write in this step (a
verify block's tokens past a query block: launch/one_token.py); positions from ``first`` (state.seg_new) on are
such rows, so the ring holds only [lo, min(hp, first)) (``segment_slots``) and compute reads the rest from the cache
after its dependency wait. In a decode batch ``first`` is the token's own position and the ring holds the whole past.

Rows outside [lo, hp) (before lo in the first slot, past hp in the last, the repeated boxes) hold real cache rows
or stale bytes; compute masks them, the V rows included (a stale e4m3 byte may be NaN, and 0 * NaN is NaN).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function


@gluon.jit
def split_range(split, n_splits, ctx):
    """state.split_range with one new position: the ctx - 1 past positions in chunks, the last split also
    holding position ctx - 1. Returns (lo, hi, the end of the past positions in [lo, hi))."""
    past = ctx - 1
    chunk = (past + n_splits - 1) // n_splits
    lo = gl.minimum(split * chunk, past)
    hp = gl.minimum(lo + chunk, past)
    return lo, gl.where(split == n_splits - 1, ctx, hp), hp


@gluon.jit
def split_slots(split, n_splits, ctx, KVS: gl.constexpr, KVBOX: gl.constexpr):
    """(lo, hi, hp, a0, n): the split's positions [lo, hi), its past ones [lo, hp), and its n ring slots of KVS
    positions from a0 (module doc); n = 0 where the split has no past position."""
    lo, hi, hp = split_range(split, n_splits, ctx)
    a0 = (lo // KVBOX) * KVBOX
    n = gl.where(hp > lo, (hp - a0 + KVS - 1) // KVS, 0)
    return lo, hi, hp, a0, n


@gluon.jit
def segment_slots(split, n_splits, ctx, first, KVS: gl.constexpr, KVBOX: gl.constexpr):
    """``split_slots`` of a multi-token step's one-token segment: (lo, hi, rp, a0, n) with rp = min(hp, first), the
    end of the past positions the ring holds (module doc); [max(lo, first), hp) are read after the wait."""
    lo, hi, hp = split_range(split, n_splits, ctx)
    rp = gl.minimum(hp, first)
    a0 = (lo // KVBOX) * KVBOX
    n = gl.where(rp > lo, (rp - a0 + KVS - 1) // KVS, 0)
    return lo, hi, rp, a0, n


@constexpr_function
def element(C):
    """The cache's element type: e4m3 (C.FP8) or bf16."""
    return gl.float8e4nv if C.FP8 else gl.bfloat16


@constexpr_function
def flat(rank):
    """An unswizzled row-major shared layout of ``rank`` dimensions: the byte order the TMA boxes (swizzle 0) and
    the scale copies write."""
    return gl.SwizzledSharedLayout(1, 1, 1, order=list(range(rank - 1, -1, -1)))


@gluon.jit
def slot_rows(bufs, idx, PL: gl.constexpr, C: gl.constexpr):
    """Ring slot ``idx`` as [2 (K, V) * KVS / BT blocks * NW, BT / NW / PL, PL, HD]: K's block u is rows
    [u NW, +NW), V's [(KVS / BT + u) NW, +NW), each [NW, BT / NW / PL, PL, HD] with block position
    w * BT / NW + i * PL + j at [w, i, j]."""
    return bufs.index(idx)._reinterpret(element(C), [2 * C.KVS // C.BT * C.NW, C.BT // C.NW // PL, PL, C.HD],
                                        flat(4))


@gluon.jit
def slot_scales(sbuf, idx, PL: gl.constexpr, C: gl.constexpr):
    """The scales of slot ``idx`` (C.FP8) as [2 * KVS / BT * NW, BT / NW / PL, PL], rows as ``slot_rows``."""
    return sbuf.index(idx)._reinterpret(gl.bfloat16, [2 * C.KVS // C.BT * C.NW, C.BT // C.NW // PL, PL], flat(3))
