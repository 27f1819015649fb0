"""Thread-block clusters for the megakernel: the launch in clusters, ATTN_IN's cluster pairs' exchange through
distributed shared memory (the default since session 16, below ``pair_region_bytes``), and the probe that decided
whether tickets could move on chip.

Twice a layer the megakernel joins the parts of one result through global memory: ATTN_IN's column parts of a
head (a ticket, then the finisher loads the other parts' sums) and the attention splits of a KV group (a ticket,
then the combine loads every split's partial). Each join is a release fence, an atomic round trip and a round of
loads through L2, ~1-2 us under the weight stream (bench/NOTES.md, sessions 12-15). On Hopper, CTAs launched as a
*cluster* can write each other's shared memory (``mapa`` + ``st.shared::cluster``, distributed shared memory) and
meet at a hardware cluster barrier (``barrier.cluster.arrive.release`` / ``wait.acquire``) without leaving the
GPC. If that is much cheaper than the ticket, the parts of a join placed on the CTAs of one cluster can swap
partials on chip.

Two things must hold first, and this probe tests both on the GPU:
1. **Launching a Gluon kernel in clusters.** Triton 3.6 launches clusters only for ``num_ctas > 1``, which also
   makes every Gluon layout span the cluster's CTAs (each would need a CGA layout). ``launch_in_clusters`` compiles
   for one CTA and then sets the launch's ``num_ctas`` (and its dynamic shared memory) in the compiled kernel's
   packed launch metadata: the driver launches ``grid * cluster`` CTAs in clusters of ``cluster``, and the code,
   compiled for one CTA, sees ``program_id`` = its CTA index.
2. **Shared memory outside Triton's allocator.** Gluon 3.6 exposes no shared-memory address, so the exchange
   region is the dynamic shared memory requested past Triton's own (``region`` bytes from ``global_smem``, the
   kernel's dynamic shared memory symbol), addressed only through inline asm.

``probe`` checks an exchange between the two CTAs of each pair (reference: ``exchange_reference``) and times
``ITERS`` rounds of (store to the peer, cluster barrier) against ``ITERS`` rounds of a pair's global ticket
(``counter_signal`` + ``counter_wait``: the megakernel's join). A persistent kernel must also have every CTA
resident at once: ``max_active_clusters`` asks the driver how many clusters of a size fit the GPU at a given
shared-memory footprint (the megakernel takes ~220 KB an SM: one CTA an SM, 66 clusters of two on 132 SMs only
if every GPC has an even number of SMs free).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .orchestration import counter_signal, counter_wait, globaltimer


@gluon.jit
def cluster_rank(like):
    """%cluster_ctarank (this CTA's index in its cluster), shaped like the int32 tensor ``like``."""
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [like], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def store_to_peer(offset, rank, value):
    """Store fp32 ``value`` at byte ``offset`` of the dynamic shared memory of CTA ``rank`` of this cluster
    (element-wise; ``mapa`` turns the local shared address into the peer's window in the cluster's space)."""
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, r; mov.u32 a, global_smem; add.u32 a, a, $1; mapa.shared::cluster.u32 r, a, $2; "
        "st.shared::cluster.f32 [r], $3; mov.u32 $0, 0; }",
        "=r,r,r,f", [offset, rank, value], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def load_local(offset):
    """fp32 at byte ``offset`` of this CTA's dynamic shared memory (element-wise)."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.f32 $0, [a]; }",
        "=f,r", [offset], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def cluster_sync(like):
    """Every thread of every CTA in the cluster arrives (release: its shared-memory stores to any CTA of the
    cluster are visible after the wait) and waits (acquire). ``.aligned``: all threads of a warp execute it
    together, so it is issued once per element of a one-element-per-thread tensor ``like``."""
    gl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;",
        "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def probe(out_ptr, ns_ptr, cnt_ptr, region, ITERS: gl.constexpr, num_warps: gl.constexpr):
    """CTA pid of a cluster of two: thread t stores pid * 1000 + t into its peer's region, then reads its own
    (``out[pid, t]``); then ``ns[pid]`` = (ns per cluster round, ns per global ticket round) over ITERS rounds."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    T: gl.constexpr = 32 * num_warps
    t = gl.arange(0, T, L)
    pid = gl.program_id(0)
    peer = cluster_rank(t) ^ 1
    offset = region + t * 4
    cluster_sync(t)  # the peer has started: its shared memory may not be written before (nor after it exits:
    # the last remote store below precedes the last barrier)
    store_to_peer(offset, peer, (pid * 1000 + t).to(gl.float32))
    cluster_sync(t)
    gl.store(out_ptr + pid * T + t, load_local(offset))
    cluster_sync(t)  # the peer has read its region before the rounds below write it again
    t0 = globaltimer()
    for i in range(ITERS):
        store_to_peer(offset, peer, (t + i).to(gl.float32))
        cluster_sync(t)
    t1 = globaltimer()
    for i in range(ITERS):  # the megakernel's join: release add, then poll until both CTAs of the pair added
        counter_signal(cnt_ptr, pid // 2)
        counter_wait(cnt_ptr, pid // 2, 2 * (i + 1))
    t2 = globaltimer()
    gl.store(ns_ptr + pid * 2, (t1 - t0) // ITERS)
    gl.store(ns_ptr + pid * 2 + 1, (t2 - t1) // ITERS)


# --- ATTN_IN's cluster pairs (isa.CLUSTER_PAIR, KernelConfig.cluster_qkv) ------------------------------------------
# The exchange region is the last ``pair_region_bytes(HD)`` bytes of the dynamic shared memory (``in_clusters``
# launches the kernel with that much past Triton's own, rounded up to 16 bytes): two mbarriers ``full[2]`` (8 bytes
# each, 16 bytes in all), then two slots of [2 parts, HD] fp32. Exchange n of a CTA (its n-th pair instruction, the
# same head as its mate's n-th) uses slot and barrier n % 2 at phase parity (n // 2) % 2. Each part stores its sums
# into its own slot and its mate's, then every compute thread arrives on the mate's ``full`` (release, cluster
# scope: its remote stores before it) and waits on its own (acquire). A CTA reaches exchange n + 2 only after its
# mate arrived for n + 1, which the mate does after it finished exchange n: a slot is never rewritten before it was
# read, and a barrier never runs a phase ahead of its waiter.


def pair_region_bytes(head_dim: int) -> int:
    """Bytes of the pair exchange region: two mbarriers, two slots of two parts' [head_dim] fp32 sums."""
    return 16 + 2 * 2 * head_dim * 4


# Each asm below first leaves in register ``a`` the shared address of the exchange region (the dynamic shared
# memory's last XB bytes, XB in operand ``$2``): a = global_smem + %dynamic_smem_size - XB (+ the byte offset $1)
@gluon.jit
def pair_init(tid, XB: gl.constexpr, XA: gl.constexpr):
    """At the start of the compute partition (``tid``: one element per compute thread): thread 0 initializes both
    ``full`` barriers (for one arrival per compute thread of the mate; ``XA``, the asynchronous stores: for its
    own one arrival, which also expects the mate's bytes) and fences the init for the cluster. The
    kernel then publishes it through global memory (its word in ``ready``, kernel.py), and a CTA waits for its
    mate's word before its first remote store: a cluster barrier (``barrier.cluster``) cannot be used, it counts
    every thread of both CTAs, and the warps Triton pads the warp-specialized CTA with never reach it."""
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; mov.u32 g, global_smem; "
        "add.u32 a, a, g; setp.eq.u32 p, $1, 0; @p mbarrier.init.shared::cta.b64 [a], $3; add.u32 a, a, 8; "
        "@p mbarrier.init.shared::cta.b64 [a], $3; @p fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }",
        "=r,r,r,r", [tid, tid * 0 + XB, tid * 0 + (1 if XA else tid.shape[0])], dtype=gl.int32, is_pure=False,
        pack=1)


@gluon.jit
def _slot_offset(idx, part, n, HD: gl.constexpr):
    """Byte offset in the exchange region of element ``idx`` of part ``part``'s sums in exchange ``n``'s slot."""
    return 16 + (n % 2) * (2 * HD * 4) + part * (HD * 4) + idx * 4


@gluon.jit
def pair_store(value, idx, part, n, XB: gl.constexpr, HD: gl.constexpr):
    """Exchange ``n``: store part ``part``'s fp32 sums ``value`` at positions ``idx`` of the head, in this CTA's
    slot and in its mate's (``mapa`` to the other rank of the cluster of two)."""
    off = _slot_offset(idx, part, n, HD)
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g, r, k; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; mov.u32 g, global_smem; "
        "add.u32 a, a, g; add.u32 a, a, $1; st.shared.f32 [a], $3; mov.u32 k, %cluster_ctarank; xor.b32 k, k, 1; "
        "mapa.shared::cluster.u32 r, a, k; st.shared::cluster.f32 [r], $3; mov.u32 $0, 0; }",
        "=r,r,r,f", [off, off * 0 + XB, value], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def pair_meet(tid, n, XB: gl.constexpr):
    """Exchange ``n``, after this thread's ``pair_store``s: arrive on the mate's ``full[n % 2]`` (release, cluster
    scope), then wait on this CTA's until the mate's threads all arrived (acquire, parity (n // 2) % 2). The
    partition barrier after it orders this CTA's own slot stores before other threads read them."""
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g, r, k; .reg .pred p; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; "
        "mov.u32 g, global_smem; add.u32 a, a, g; add.u32 a, a, $1; mov.u32 k, %cluster_ctarank; xor.b32 k, k, 1; "
        "mapa.shared::cluster.u32 r, a, k; mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r]; "
        "WAIT: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [a], $3; @!p bra WAIT; "
        "mov.u32 $0, 0; }",
        "=r,r,r,r", [tid * 0 + (n % 2) * 8, tid * 0 + XB, tid * 0 + (n // 2) % 2], dtype=gl.int32, is_pure=False,
        pack=1)
    gl.thread_barrier()


@gluon.jit
def pair_store_async(value, idx, part, n, XB: gl.constexpr, HD: gl.constexpr):
    """``pair_store`` with asynchronous remote stores (KernelConfig.cluster_qkv=2): ``value`` [TR] (TR <= 32) in the
    layout ``[1], [32], [num_warps]``, whose element e threads e, e + 32, ... of the partition hold; every copy is
    stored locally, and the copy of thread e alone goes to the mate with ``st.async``, which adds its 4 bytes to the
    transaction count of the mate's ``full[n % 2]`` when it lands: no fence, no arrival from this side."""
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
def pair_meet_async(tid, n, XB: gl.constexpr, HD: gl.constexpr, NBYTES: gl.constexpr = 0):
    """``pair_meet`` for ``pair_store_async``: thread 0 arrives on this CTA's ``full[n % 2]`` expecting the mate's
    HD * 4 bytes (``NBYTES`` where given: DOWN_PROJ's pairs swap one row tile's sums an exchange; they may have
    landed already: the transaction count runs negative until then), then every thread waits for the phase
    (parity (n // 2) % 2), and a partition barrier orders this CTA's own slot stores."""
    EXPECT: gl.constexpr = NBYTES if NBYTES > 0 else HD * 4
    gl.inline_asm_elementwise(
        "{ .reg .u32 a, g; .reg .pred p, z; mov.u32 a, %dynamic_smem_size; sub.u32 a, a, $2; "
        "mov.u32 g, global_smem; add.u32 a, a, g; add.u32 a, a, $1; setp.eq.u32 z, $4, 0; "
        "@z mbarrier.arrive.expect_tx.shared::cta.b64 _, [a], $5; "
        "WAIT: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [a], $3; @!p bra WAIT; "
        "mov.u32 $0, 0; }",
        "=r,r,r,r,r,r", [tid * 0 + (n % 2) * 8, tid * 0 + XB, tid * 0 + (n // 2) % 2, tid, tid * 0 + EXPECT],
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


def in_clusters(compiled, cluster: int, extra_bytes: int):
    """Make every launch of ``compiled`` (a CompiledKernel for one CTA: the JIT's cached kernel of one
    specialization) run its grid x ``cluster`` CTAs in clusters of ``cluster``, with ``extra_bytes`` of dynamic
    shared memory past Triton's own (rounded up to 16 bytes): triton 3.6's launcher takes the cluster size and the
    dynamic shared memory from the packed launch metadata (num_warps, num_ctas, shared). Idempotent."""
    num_warps = compiled.packed_metadata[0]
    compiled.packed_metadata = (num_warps, cluster, -(-compiled.metadata.shared // 16) * 16 + extra_bytes)
    return compiled


def exchange_reference(n_ctas: int, threads: int) -> torch.Tensor:
    """What ``probe`` leaves in ``out`` [n_ctas, threads]: CTA pid reads what its pair mate pid ^ 1 stored."""
    pid = torch.arange(n_ctas).unsqueeze(1)
    return ((pid ^ 1) * 1000 + torch.arange(threads)).float()


def launch_in_clusters(kernel, n_ctas: int, cluster: int, region_bytes: int, args: tuple, constexprs: dict):
    """Launch ``kernel`` (compiled for one CTA) as ``n_ctas`` CTAs in clusters of ``cluster``, with
    ``region_bytes`` of dynamic shared memory past Triton's own; ``args`` end with the region's byte offset, which
    this fills in (a 16-byte multiple). Returns the compiled kernel: the JIT's cached one, so later launches of the
    same specialization also run in clusters."""
    if n_ctas % cluster:
        raise ValueError(f"{n_ctas} CTAs do not form clusters of {cluster}")
    compiled = in_clusters(kernel.warmup(*args, 16, grid=(n_ctas // cluster,), **constexprs), cluster, region_bytes)
    kernel[(n_ctas // cluster,)](*args, -(-compiled.metadata.shared // 16) * 16, **constexprs)
    return compiled


def max_active_clusters(function: int, cluster: int, threads: int, smem_bytes: int) -> int:
    """cuOccupancyMaxActiveClusters for CUfunction ``function`` launched in clusters of ``cluster`` CTAs of
    ``threads`` threads with ``smem_bytes`` of dynamic shared memory (the driver API through ctypes: torch and
    triton expose no cluster occupancy query)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    class Attr(ctypes.Structure):  # CUlaunchAttribute: an enum id, padding to 8, a 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]

    class Config(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)), ("num_attrs", ctypes.c_uint)]

    fn = ctypes.c_void_p(function)
    rc = cuda.cuFuncSetAttribute(fn, 8, ctypes.c_int(smem_bytes))  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute({smem_bytes} bytes of dynamic shared memory): CUresult {rc}")
    attr = Attr(id=4)  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
    cfg = Config((ctypes.c_uint * 3)(cluster, 1, 1), (ctypes.c_uint * 3)(threads, 1, 1), smem_bytes, None,
                 ctypes.pointer(attr), 1)
    n = ctypes.c_int(0)
    rc = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(cfg))
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters: CUresult {rc}")
    return n.value


def run_probe(n_ctas: int = 132, iters: int = 1000, num_warps: int = 4, device: str = "cuda") -> dict:
    """``probe`` on ``n_ctas`` CTAs in clusters of two: whether the exchange matches, and the median ns of a
    cluster round and of a global ticket round."""
    threads = 32 * num_warps
    out = torch.full((n_ctas, threads), float("nan"), device=device)
    ns = torch.zeros(n_ctas, 2, dtype=torch.int64, device=device)
    cnt = torch.zeros(n_ctas // 2, dtype=torch.int32, device=device)
    compiled = launch_in_clusters(probe, n_ctas, 2, threads * 4, (out, ns, cnt),
                                  dict(ITERS=iters, num_warps=num_warps))
    torch.cuda.synchronize()
    ok = torch.equal(out.cpu(), exchange_reference(n_ctas, threads))
    med = ns.float().median(dim=0).values.tolist()
    # clusters of 2 (the ATTN_IN pairs), 4 and 8 (the portable maximum: a KV head's attention splits): how many fit
    # with 16 KB an SM, and with the megakernel's ~213 KB (the 1B with the deepest ring) and 220 KB
    fits = {f"clusters_of_{c}_at_{kb}kb": max_active_clusters(compiled.function, c, threads, kb * 1024)
            for c in (2, 4, 8) for kb in (16, 213, 220)}
    return dict(exchange_ok=ok, cluster_round_ns=med[0], ticket_round_ns=med[1], ctas=n_ctas, iters=iters,
                sms=torch.cuda.get_device_properties(device).multi_processor_count, **fits)


if __name__ == "__main__":
    print(run_probe())
