"""The probe that decided whether the megakernel's joins could move on chip (device/cluster.py's design): an
exchange through distributed shared memory between the two CTAs of each cluster of two, timed against the
megakernel's global join (a release add and an acquire poll), plus how many clusters the GPU keeps resident at the
megakernel's shared-memory footprint (launch/clusters.py).

``probe`` checks the exchange (reference: ``exchange_reference``) and times ``ITERS`` rounds of (store to the peer,
cluster barrier) against ``ITERS`` rounds of a pair's global ticket. Run on the GPU: ``python -m
mimw.megakernel.tools.cluster_probe``.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..device.sync import counter_signal, counter_wait, globaltimer
from ..launch.clusters import in_clusters, max_active_clusters


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


def exchange_reference(n_ctas: int, threads: int) -> torch.Tensor:
    """What ``probe`` leaves in ``out`` [n_ctas, threads]: CTA pid reads what its pair mate pid ^ 1 stored."""
    pid = torch.arange(n_ctas).unsqueeze(1)
    return ((pid ^ 1) * 1000 + torch.arange(threads)).float()


def launch_in_clusters(kernel, n_ctas: int, cluster: int, region_bytes: int, args: tuple, constexprs: dict):
    """Launch ``kernel`` (compiled for one CTA) as ``n_ctas`` CTAs in clusters of ``cluster``, with
    ``region_bytes`` of dynamic shared memory past Triton's own; ``args`` end with the region's byte offset, which
    this fills in (a 16-byte multiple). Returns the compiled kernel."""
    if n_ctas % cluster:
        raise ValueError(f"{n_ctas} CTAs do not form clusters of {cluster}")
    compiled = in_clusters(kernel.warmup(*args, 16, grid=(n_ctas // cluster,), **constexprs), cluster, region_bytes)
    kernel[(n_ctas // cluster,)](*args, -(-compiled.metadata.shared // 16) * 16, **constexprs)
    return compiled


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
    # clusters of 2 (the cluster pairs), 4 and 8 (the portable maximum): how many fit with 16 KB an SM, and with the
    # megakernel's ~213 KB and 220 KB
    fits = {f"clusters_of_{c}_at_{kb}kb": max_active_clusters(compiled.function, c, threads, kb * 1024)
            for c in (2, 4, 8) for kb in (16, 213, 220)}
    return dict(exchange_ok=ok, cluster_round_ns=med[0], ticket_round_ns=med[1], ctas=n_ctas, iters=iters,
                sms=torch.cuda.get_device_properties(device).multi_processor_count, **fits)


if __name__ == "__main__":
    print(run_probe())
