"""The multi-token step's matvec, measured alone: Y[M, N] = X[M, K] . W[N, K]^T on wgmma with W streamed once.

A multi-token step (a decode batch, a verify block) reads the same weights as a one-token step; what changes is the
narrow operand: M tokens' activations instead of one vector. This kernel is that inner loop, outside the megakernel,
so that its correctness and its bandwidth against the floor (W's bytes / streaming read) can be measured for M = 1
.. 64 before the megakernel's instructions use it:
  * W is packed exactly as the megakernel packs it (launch/pack.py: [TR, TK] = [32, 256] tiles stored chunk-major),
    streamed by a one-warp loader with TMA through an NB-slot ring (the megakernel's roles, device/ring.py);
  * X is staged, K-group by K-group (GK column tiles, GK * 256 columns), into shared memory as bf16 chunks of
    [64 tokens, 32 columns] (rows past M zero), the A operand of wgmma;
  * each tile chunk j (the tile's 32 rows, columns [32j, 32j + 32)) is the K-major B operand of one
    ``warpgroup_mma`` (m64 n32 k16 x 2) into an fp32 [64 tokens, 32 rows] accumulator;
  * one CTA a row tile at a time, persistent over the row tiles.
Run on a Hopper GPU: ``python -m mimw.megakernel.tools.skinny_gemm`` (correctness against torch, then ms and TB/s
per M against the streaming-read floor and torch's bf16 matmul).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

TR, TK, FK = 32, 256, 32  # the megakernel's tile: 32 rows x 256 columns, chunks of 32 columns
MP = 64  # tokens padded to wgmma's 64 rows


@gluon.jit
def _loader(w_desc, bufs, empty, ready, NRT, KT, GK: gl.constexpr):
    NB: gl.constexpr = bufs.type.shape[0]
    BR: gl.constexpr = w_desc.block_type.shape[0]
    it = 0
    for rt in range(gl.program_id(0), NRT, gl.num_programs(0)):
        for g0 in range(0, KT, GK):
            for k in range(g0, gl.minimum(g0 + GK, KT)):
                idx = it % NB
                mbarrier.wait(empty.index(idx), ((it // NB) & 1) ^ 1)
                mbarrier.expect(ready.index(idx), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [(rt * KT + k) * BR, 0], ready.index(idx), bufs.index(idx))
                it += 1


@gluon.jit
def _compute(x_ptr, y_ptr, M, K, N, NRT, KT, bufs, empty, ready, xs, GK: gl.constexpr, num_warps: gl.constexpr):
    NB: gl.constexpr = bufs.type.shape[0]
    NF: gl.constexpr = 8  # chunks a tile
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])  # [64, 32] chunk, 16-byte vectors
    t = gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(1, XL)), 1)
    c = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, XL)), 0)
    it = 0
    for rt in range(gl.program_id(0), NRT, gl.num_programs(0)):
        acc = gl.zeros([64, 32], gl.float32, ACC)
        for g0 in range(0, KT, GK):
            # stage the group's columns of X as bf16 [64, 32] chunks (rows past M and columns past K zero)
            for ch in gl.static_range(GK * NF):
                col = g0 * 256 + ch * 32 + c
                v = gl.load(x_ptr + t * K + col, mask=(t < M) & (col < K), other=0.0)
                xs.index(ch).store(v.to(gl.bfloat16))
            fence_async_shared()  # the generic-proxy stores before the async proxy (wgmma) reads them
            gl.thread_barrier()
            for kk in range(0, gl.minimum(GK, KT - g0)):
                idx = it % NB
                mbarrier.wait(ready.index(idx), (it // NB) & 1)
                slot = bufs.index(idx)
                for j in gl.static_range(NF):
                    acc = warpgroup_mma(xs.index(kk * NF + j), slot.slice(j * 32, 32).permute((1, 0)), acc,
                                        is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(idx), count=1)
                it += 1
            gl.thread_barrier()  # every warp's wgmma has read xs before the next group restages it
        tt = gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(1, ACC)), 1)
        n = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, ACC)), 0)
        gl.store(y_ptr + tt * N + rt * 32 + n, acc, mask=tt < M)


@gluon.jit
def skinny_gemm(w_desc, x_ptr, y_ptr, M, K, N, NRT, KT, GK: gl.constexpr, NB: gl.constexpr,
                num_warps: gl.constexpr):
    bufs = gl.allocate_shared_memory(w_desc.dtype, [NB, w_desc.block_type.shape[0], w_desc.block_type.shape[1]],
                                     w_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NB):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
    xs = gl.allocate_shared_memory(gl.bfloat16, [GK * 8, 64, 32], gl.NVMMASharedLayout.get_default_for([64, 32],
                                                                                                    gl.bfloat16))
    gl.warp_specialize([
        (_compute, (x_ptr, y_ptr, M, K, N, NRT, KT, bufs, empty, ready, xs, GK, num_warps)),
        (_loader, (w_desc, bufs, empty, ready, NRT, KT, GK)),
    ], [1], [48])


def run(w_tiles: torch.Tensor, x: torch.Tensor, n: int, k: int, gk: int = 2, nb: int = 8, grid: int | None = None):
    """Y [M, n] fp32 for x [M, k] fp32 and ``w_tiles`` (launch/pack.tile_major of W [n, k], viewed [*, 32])."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    box = [TR * TK // 32, 32]
    desc = TensorDescriptor.from_tensor(w_tiles, box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))
    m = x.shape[0]
    y = torch.full((m, n), float("nan"), device=x.device)
    nrt, kt = n // TR, -(-k // TK)
    grid = grid or torch.cuda.get_device_properties(x.device).multi_processor_count
    skinny_gemm[(min(grid, nrt),)](desc, x, y, m, k, n, nrt, kt, GK=gk, NB=nb, num_warps=4)
    return y


def main() -> None:
    import triton

    from ..launch.pack import tile_major
    from ..tools.variants import read_bandwidth

    bw = read_bandwidth()
    print(f"read bandwidth {bw / 1e12:.2f} TB/s")
    torch.manual_seed(0)
    rows = []
    for n, k in ((16384, 2048), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        tiles = tile_major(w, TR, TK).reshape(-1, 32).contiguous()
        for m in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(m, k, device="cuda")
            y = run(tiles, x, n, k)
            ref = x.to(torch.bfloat16).float() @ w.float().t()
            err = float((y - ref).abs().max() / ref.abs().max())
            ms = triton.testing.do_bench(lambda: run(tiles, x, n, k), return_mode="median")
            xb = x.to(torch.bfloat16)
            ms_t = triton.testing.do_bench(lambda: xb @ w.t(), return_mode="median")
            floor = n * k * 2 / bw * 1e3
            rows.append((n, k, m, err, ms, ms / floor, ms_t))
            print(f"N={n} K={k} M={m:2d}: err {err:.1e}  {ms * 1e3:7.1f} us  {ms / floor:5.2f}x floor  "
                  f"torch {ms_t * 1e3:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
