"""Cluster pairs: two parts of one result on the two CTAs of a thread-block cluster swap their sums on chip.

Twice a layer the megakernel joins the parts of a result: ATTN_IN's two column parts of a head, and (where its row
blocks would leave half the SMs idle) DOWN_PROJ's two column halves of a row block. Through global memory a join is
a release fence, an atomic ticket and a round of loads through L2 (~1-2 us under the weight stream). CTAs launched
as a cluster can write each other's shared memory (``mapa`` + ``st.async``, distributed shared memory), so the
parts placed on the two CTAs of one cluster (isa.CLUSTER_PAIR; the scheduler gives both queues the same pairs in the
same order) swap their sums there.

The exchange region is the last ``plan.exchange_bytes(HD)`` bytes of the dynamic shared memory, requested past
Triton's own at launch (launch/clusters.py; Gluon 3.6 exposes no shared-memory address, so it is addressed through
inline asm from ``global_smem + %dynamic_smem_size - XB``): two mbarriers ``full[2]`` (8 bytes each), then two slots
of [2 parts, HD] fp32. Exchange n of a CTA (its n-th pair instruction, the same unit as its mate's n-th) uses slot and
barrier n % 2 at phase parity (n // 2) % 2. Each part stores its sums into its own slot and, with ``st.async``, into
its mate's, which counts the bytes on the mate's ``full`` barrier when they land: no fence, no remote arrival. Thread
0 arrives on its own barrier expecting the mate's bytes; every thread waits for the phase. A CTA reaches exchange
n + 2 only after its mate's bytes for n + 1 landed, which the mate sends after it finished exchange n: a slot is
never rewritten before it was read.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Each asm below first leaves in register ``a`` the shared address of the exchange region (the dynamic shared
# memory's last XB bytes, XB in an operand): a = global_smem + %dynamic_smem_size - XB (+ a byte offset)


@gluon.jit
def pair_init(tid, XB: gl.constexpr):
    """At the start of the compute partition (``tid``: one element per compute thread): thread 0 initializes both
    ``full`` barriers for its own one arrival (which also expects the mate's bytes) and fences the init for the
    cluster. The kernel then publishes it through global memory (its ready word), and a CTA waits for its mate's word
    before its first remote store: a cluster barrier cannot be used, it counts every thread of both CTAs, and the
    warps Triton pads the warp-specialized CTA with never reach it."""
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; mov.u32 g, global_smem; "
        "add.u32 a, a, g; setp.eq.u32 p, $1, 0; @p mbarrier.init.shared::cta.b64 [a], 1; add.u32 a, a, 8; "
        "@p mbarrier.init.shared::cta.b64 [a], 1; @p fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }",
        "=r,r,r", [tid, tid * 0 + XB], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _slot_offset(idx, part, n, HD: gl.constexpr):
    """Byte offset in the exchange region of element ``idx`` of part ``part``'s sums in exchange ``n``'s slot."""
    return 16 + (n % 2) * (2 * HD * 4) + part * (HD * 4) + idx * 4


@gluon.jit
def pair_store(value, idx, part, n, XB: gl.constexpr, HD: gl.constexpr):
    """Exchange ``n``: part ``part``'s fp32 sums ``value`` [TR] (TR <= 32, layout ``[1], [32], [num_warps]``, whose
    element e threads e, e + 32, ... hold) at positions ``idx`` of the slot: every copy is stored locally, and the
    copy of thread e alone goes to the mate with ``st.async``, which adds its 4 bytes to the transaction count of the
    mate's ``full[n % 2]`` when it lands."""
    gl.static_assert(value.shape[0] <= 32, "one owner thread an element: at most 32 rows a tile")
    off = _slot_offset(idx, part, n, HD)
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g, b, r, q, k, t; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; "
        "mov.u32 g, global_smem; add.u32 a, a, g; add.u32 b, a, $3; add.u32 a, a, $1; st.shared.f32 [a], $5; "
        "mov.u32 t, %tid.x; setp.lt.u32 p, t, $4; mov.u32 k, %cluster_ctarank; xor.b32 k, k, 1; "
        "mapa.shared::cluster.u32 r, a, k; mapa.shared::cluster.u32 q, b, k; "
        "@p st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [r], $5, [q]; mov.u32 $0, 0; }",
        "=r,r,r,r,r,f", [off, off * 0 + XB, off * 0 + (n % 2) * 8, off * 0 + value.shape[0], value], dtype=gl.int32,
        is_pure=False, pack=1)


@gluon.jit
def pair_meet(tid, n, XB: gl.constexpr, NBYTES: gl.constexpr):
    """Exchange ``n``, after this thread's ``pair_store``s: thread 0 arrives on this CTA's ``full[n % 2]``
    expecting the mate's NBYTES (they may have landed already: the transaction count runs negative until then),
    then every thread waits for the phase (parity (n // 2) % 2), and a partition barrier orders this CTA's own slot
    stores before other threads read them."""
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g; .reg .pred p, z; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; "
        "mov.u32 g, global_smem; add.u32 a, a, g; add.u32 a, a, $1; setp.eq.u32 z, $4, 0; "
        "@z mbarrier.arrive.expect_tx.shared::cta.b64 _, [a], $5; "
        "WAIT: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [a], $3; @!p bra WAIT; "
        "mov.u32 $0, 0; }",
        "=r,r,r,r,r,r", [tid * 0 + (n % 2) * 8, tid * 0 + XB, tid * 0 + (n // 2) % 2, tid, tid * 0 + NBYTES],
        dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()


@gluon.jit
def pair_load(idx, part, n, XB: gl.constexpr, HD: gl.constexpr):
    """Exchange ``n``: part ``part``'s sums at positions ``idx`` of the head, from this CTA's slot."""
    off = _slot_offset(idx, part, n, HD)
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a, g; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; mov.u32 g, global_smem; "
        "add.u32 a, a, g; add.u32 a, a, $1; ld.shared.f32 $0, [a]; }",
        "=f,r,r", [off, off * 0 + XB], dtype=gl.float32, is_pure=False, pack=1)
