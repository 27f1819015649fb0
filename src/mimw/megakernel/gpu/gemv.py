"""A standalone warp-specialized GEMV y = W x (decode matvec) built only from ``orchestration``: the smallest
complete use of the ring, the loader role and the consumer role, tested against torch. The megakernel's matvec
instructions are this loop, with many row blocks per CTA and the loader running ahead across them.

One CTA per BN-row block; a one-warp loader TMA-streams [BN, BK] tiles of W into an NB-slot ring; the compute
partition reduces each tile against the matching chunk of x (bf16 in, fp32 accumulate, bf16 out).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .orchestration import consumer_acquire, consumer_release, producer_rows, ring_init


@gluon.jit
def _gemv_loader(w_desc, bufs, empty, ready, K):
    BN: gl.constexpr = bufs.type.shape[1]
    BK: gl.constexpr = bufs.type.shape[2]
    producer_rows(w_desc, gl.program_id(0) * BN, 1, 0, gl.cdiv(K, BK), bufs, empty, ready, gl.to_tensor(0), BN, BK)


@gluon.jit
def _gemv_compute(x_ptr, y_ptr, bufs, empty, ready, K, num_warps: gl.constexpr):
    BN: gl.constexpr = bufs.type.shape[1]
    BK: gl.constexpr = bufs.type.shape[2]
    LAY: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    offs_k = gl.arange(0, BK, gl.SliceLayout(0, LAY))
    acc = gl.zeros([BN, BK], gl.float32, LAY)
    for k in range(gl.cdiv(K, BK)):
        xk = gl.load(x_ptr + k * BK + offs_k, mask=k * BK + offs_k < K, other=0.0).to(gl.float32)
        w, idx = consumer_acquire(bufs, ready, k, LAY)
        consumer_release(empty, idx)
        acc += w.to(gl.float32) * gl.expand_dims(xk, 0)
    rows = gl.program_id(0) * BN + gl.arange(0, BN, gl.SliceLayout(1, LAY))
    gl.store(y_ptr + rows, gl.sum(acc, axis=1).to(gl.bfloat16))


@gluon.jit
def ws_gemv(w_desc, x_ptr, y_ptr, K, NB: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(w_desc.dtype, [NB, BN, BK], w_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    ring_init(empty, ready, NB)
    gl.warp_specialize([
        (_gemv_compute, (x_ptr, y_ptr, bufs, empty, ready, K, num_warps)),
        (_gemv_loader, (w_desc, bufs, empty, ready, K)),
    ], [1], [24])


def gemv(w, x, bn: int = 64, bk: int = 256, nb: int = 4, num_warps: int = 4):
    """y = w @ x for bf16 w [N, K] (N % bn == 0) and x [K] on a Hopper GPU; returns bf16 [N]."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, k = w.shape
    if n % bn:
        raise ValueError(f"rows {n} must be a multiple of bn={bn}")
    lay = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    desc = TensorDescriptor.from_tensor(w, [bn, bk], lay)
    y = torch.full((n,), float("nan"), device=w.device, dtype=torch.bfloat16)
    ws_gemv[(n // bn,)](desc, x, y, k, NB=nb, num_warps=num_warps)
    return y


def reference(w, x):
    """PyTorch reference of ``gemv``: fp32 accumulate, bf16 result."""
    return (w.float() @ x.float()).to(w.dtype)
