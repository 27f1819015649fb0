"""Launching the megakernel in clusters of two CTAs (the cluster pairs, device/cluster.py), and checking that the
GPU can keep every cluster resident.

Triton 3.6 launches clusters only for ``num_ctas > 1``, which also makes every Gluon layout span the cluster's
CTAs. ``in_clusters`` instead compiles for one CTA and then sets the launch's cluster size and its dynamic shared
memory (Triton's own plus the exchange region) in the compiled kernel's packed launch metadata: the driver launches
``grid * cluster`` CTAs in clusters of ``cluster``, and the code, compiled for one CTA, sees ``program_id`` = its
CTA index. A persistent kernel must also have every CTA resident at once: ``max_active_clusters`` asks the driver
how many clusters fit the GPU at the kernel's shared-memory footprint.
"""
from __future__ import annotations


def in_clusters(compiled, cluster: int, extra_bytes: int):
    """Make every launch of ``compiled`` (a CompiledKernel for one CTA: the JIT's cached kernel of one
    specialization) run its grid x ``cluster`` CTAs in clusters of ``cluster``, with ``extra_bytes`` of dynamic
    shared memory past Triton's own (rounded up to 16 bytes): triton 3.6's launcher takes the cluster size and the
    dynamic shared memory from the packed launch metadata (num_warps, num_ctas, shared). Idempotent."""
    num_warps = compiled.packed_metadata[0]
    compiled.packed_metadata = (num_warps, cluster, -(-compiled.metadata.shared // 16) * 16 + extra_bytes)
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
