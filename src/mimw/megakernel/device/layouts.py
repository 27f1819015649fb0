"""Register layouts of the compute partition, derived from the kernel's constants ``C`` (plan.Constants)."""
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function


@constexpr_function
def tile(C):
    """LAY [TR, TK]: a weight tile's rows over WR warps (16-byte vectors along K); its SliceLayout(1) holds a row
    tile's outputs."""
    wr = min(C.NW, C.TR // 4)
    return gl.BlockedLayout([1, 8], [4, 8], [wr, C.NW // wr], [1, 0])


@constexpr_function
def staging(C):
    """S2 [SG column tiles, TK]: each staged row spread over every thread, the SG rows in registers."""
    return gl.BlockedLayout([1, C.TK // (32 * C.NW)], [1, 32], [1, C.NW], [1, 0])


@constexpr_function
def half_head(C):
    """E2 [HD / 2TR, TR]: half a head (RoPE pairs element i with i + HD/2)."""
    return gl.BlockedLayout([1, 1], [32 // C.TR, C.TR], [C.NW, 1], [1, 0])


@constexpr_function
def attention(C):
    """L4 [warp, GP heads, BT / NW positions, HD]: 16-byte vectors along HD, one warp per run of positions; the
    lanes not on HD go over the positions, or where a group has more than four heads (the 30B-A3B's eight) first
    over the heads, so that a thread's queries and outputs stay at four heads' worth of registers."""
    tpd = min(32, C.HD // 8)
    hh = max(1, min(32 // tpd, C.GP // 4))
    return gl.BlockedLayout([1, C.GP // hh, 1, 8], [1, hh, 32 // tpd // hh, tpd], [C.NW, 1, 1, 1], [3, 2, 1, 0])


@constexpr_function
def combine(C):
    """R3 [GP heads, SP2 splits, HD]: the splits' partials of one KV group, loaded in one round."""
    tpr = min(32, C.HD // 4)
    return gl.BlockedLayout([1, 1, 4], [1, 32 // tpr, tpr], [1, C.NW, 1], [2, 1, 0])


@constexpr_function
def thread(C):
    """WL [32 * NW]: one element a compute thread (also the instruction words' layout)."""
    return gl.BlockedLayout([1], [32], [C.NW], [0])


@constexpr_function
def experts(C):
    """EL [EP2]: a router's logits, the E experts padded to a power of two, a few a compute thread."""
    return gl.BlockedLayout([max(1, C.EP2 // (32 * C.NW))], [32], [C.NW], [0])


@constexpr_function
def token_experts(C):
    """[8, EP2]: eight tokens' router logits, one token a row (rows over the warps), experts over lanes."""
    return gl.BlockedLayout([1, max(1, C.EP2 // 32)], [1, 32], [C.NW, 1], [1, 0])


@constexpr_function
def kv_scales(C):
    """[KVS / KVBOX boxes, KVBOX rows]: one slot's K (or V) scales as the loader copies them (device/ring.py), V
    bf16 a copy (4 to 16 bytes: cp.async's sizes), the warp's 32 lanes over as many copies as there are, no lane
    repeating another's while there are 32 copies or more (plan.kv_ring keeps KVS >= 64 at fp8)."""
    v = min(8, C.KVBOX, max(2, C.KVS // 32))
    tc = C.KVBOX // v
    return gl.BlockedLayout([1, v], [32 // tc, tc], [1, 1], [1, 0])


@constexpr_function
def position_lanes(C):
    """PL: the lanes ``attention`` puts over a block's positions (those not on head_dim or heads)."""
    tpd = min(32, C.HD // 8)
    return 32 // tpd // max(1, min(32 // tpd, C.GP // 4))


@constexpr_function
def attention_lanes(C):
    """L5 [warp, GP heads, BT / NW / PL positions, PL lanes, HD]: ``attention``'s layout with a warp's positions
    split into the ones a thread holds (axis 2) and the PL lanes that hold them (axis 3), so that each lane can keep
    its own online-softmax state over its positions (ops/attn_partial._ring_block): a thread's registers the same,
    its positions the same (position w * BT / NW + i * PL + lane)."""
    tpd = min(32, C.HD // 8)
    hh = max(1, min(32 // tpd, C.GP // 4))
    pl = 32 // tpd // hh
    return gl.BlockedLayout([1, C.GP // hh, max(1, C.BT // C.NW // pl), 1, 8], [1, hh, 1, pl, tpd], [C.NW, 1, 1, 1, 1],
                            [4, 3, 2, 1, 0])


@constexpr_function
def top_k_rows(C):
    """K2: a token's k chosen experts rounded up to a power of two (an EXPERT_DOWN finisher's gather)."""
    return triton.next_power_of_2(max(1, C.K))


@constexpr_function
def slot_tokens(C):
    """[S2 slots, MB tokens]: a layer's routing weights, the slots over a warp's lanes (a token's reductions over
    the slots stay in its warp), the tokens over the warps."""
    return gl.BlockedLayout([1, 1], [32, 1], [1, C.NW], [0, 1])


@constexpr_function
def chosen_parts(C):
    """[K2, TR, MB]: the routing slots' partial sums of a row tile that each token chose, a token's k slots in one
    thread (their sum is the thread's own, in slot order), two rows a thread (8-byte vectors: a slot's row tile is
    contiguous), the rest of the tile over the lanes and warps."""
    tl = 32 // C.MB if C.MB <= 32 else 1
    return gl.BlockedLayout([top_k_rows(C), 2, 1], [1, tl, 32 // tl], [1, C.NW, 1], [1, 2, 0])


@constexpr_function
def slot_rows(C):
    """[S2, TR]: one token's routing slots' partial sums of a row tile, every slot in one thread (their sum is the
    thread's own, in slot order), the rows over the lanes."""
    return gl.BlockedLayout([C.S2, 1], [1, 32], [1, C.NW], [1, 0])
