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
``skinny_gemm_swap`` swaps the operands (the order issue 25 names): the tile's chunk pairs are the 64-row A, read
from the ring slot in place, and the tokens the narrow B (N = M rounded up to 8), so the staged X is compact
([M8, K] instead of [64, K]: staged once for every row tile when it fits) and one tile's wgmmas stay in flight while
the next tile's issue. The two are measured side by side; the one that loses goes.
Run on a Hopper GPU: ``python -m mimw.megakernel.tools.skinny_gemm`` (correctness against torch, then ms and TB/s
per M against the streaming-read floor and torch's bf16 matmul).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from ..device.ring import ring_init

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
def _ring(w_desc, NB: gl.constexpr):
    """The weight ring: NB tile slots and their empty/ready barriers (the megakernel's, device/ring.py)."""
    bufs = gl.allocate_shared_memory(w_desc.dtype, [NB, w_desc.block_type.shape[0], w_desc.block_type.shape[1]],
                                     w_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    ring_init(empty, ready, NB)
    return bufs, empty, ready


@gluon.jit
def skinny_gemm(w_desc, x_ptr, y_ptr, M, K, N, NRT, KT, GK: gl.constexpr, NB: gl.constexpr,
                num_warps: gl.constexpr):
    bufs, empty, ready = _ring(w_desc, NB)
    xs = gl.allocate_shared_memory(gl.bfloat16, [GK * 8, 64, 32], gl.NVMMASharedLayout.get_default_for([64, 32],
                                                                                                    gl.bfloat16))
    gl.warp_specialize([
        (_compute, (x_ptr, y_ptr, M, K, N, NRT, KT, bufs, empty, ready, xs, GK, num_warps)),
        (_loader, (w_desc, bufs, empty, ready, NRT, KT, GK)),
    ], [1], [48])


@gluon.jit
def _stage_x(x_ptr, xs, M, K, k0, NCH: gl.constexpr, MB: gl.constexpr, num_warps: gl.constexpr):
    """xs[ch] <- X[:, k0 + 32 ch .. + 32) as bf16 [MB, 32] chunks (rows past M and columns past K zero)."""
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
    t = gl.expand_dims(gl.arange(0, MB, gl.SliceLayout(1, XL)), 1)
    c = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, XL)), 0)
    for ch in gl.static_range(NCH):
        col = k0 + ch * 32 + c
        v = gl.load(x_ptr + t * K + col, mask=(t < M) & (col < K), other=0.0)
        xs.index(ch).store(v.to(gl.bfloat16))
    fence_async_shared()  # the generic-proxy stores before the async proxy (wgmma) reads them
    gl.thread_barrier()


@gluon.jit
def _compute_swap(x_ptr, y_ptr, M, K, N, NRT, KT, bufs, empty, ready, xs, ys, GK: gl.constexpr,
                  MB: gl.constexpr, num_warps: gl.constexpr):
    NB: gl.constexpr = bufs.type.shape[0]
    NF: gl.constexpr = 8  # chunks a tile
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, MB, 16])
    OUT: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    whole = GK * 256 >= K  # X fits the staging buffer: staged once for every row tile
    if whole:
        _stage_x(x_ptr, xs, M, K, 0, GK * NF, MB, num_warps)
    it = 0
    prev = 0
    for rt in range(gl.program_id(0), NRT, gl.num_programs(0)):
        acc_e = gl.zeros([64, MB], gl.float32, ACC)  # rows 0..31: even chunks' sums (rows 32..63 unused)
        acc_o = gl.zeros([64, MB], gl.float32, ACC)  # rows 32..63: odd chunks' sums (rows 0..31 unused)
        for g0 in range(0, KT, GK):
            if not whole:
                _stage_x(x_ptr, xs, M, K, g0 * 256, GK * NF, MB, num_warps)
            for kk in range(0, gl.minimum(GK, KT - g0)):
                idx = it % NB
                mbarrier.wait(ready.index(idx), (it // NB) & 1)
                slot = bufs.index(idx)
                for q in gl.static_range(NF // 2):
                    a = slot.slice(q * 64, 64)  # chunks 2q (rows 0..31) and 2q + 1 (rows 32..63): the tile's rows
                    acc_e = warpgroup_mma(a, xs.index(kk * NF + 2 * q).permute((1, 0)), acc_e, is_async=True)
                    acc_o = warpgroup_mma(a, xs.index(kk * NF + 2 * q + 1).permute((1, 0)), acc_o, is_async=True)
                # one tile's wgmma groups stay in flight: the previous tile's are complete, its slot goes back
                acc_e, acc_o = warpgroup_mma_wait(num_outstanding=NF, deps=(acc_e, acc_o))
                if it > 0:
                    mbarrier.arrive(empty.index(prev), count=1)
                prev = idx
                it += 1
            if not whole:  # every wgmma has read xs before the next group restages it
                acc_e, acc_o = warpgroup_mma_wait(num_outstanding=0, deps=(acc_e, acc_o))
                gl.thread_barrier()
        acc_e, acc_o = warpgroup_mma_wait(num_outstanding=0, deps=(acc_e, acc_o))
        r = gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(1, ACC)), 1)
        ys.store(gl.where(r < 32, acc_e, acc_o))  # [64, MB]: the even chunks' sums over the odd chunks'
        gl.thread_barrier()
        y = ys.slice(0, 32).load(OUT) + ys.slice(32, 32).load(OUT)  # [32, MB]: row r, every chunk
        gl.thread_barrier()  # read before the next row tile's store
        rr = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(1, OUT)), 1)
        mm = gl.expand_dims(gl.arange(0, MB, gl.SliceLayout(0, OUT)), 0)
        gl.store(y_ptr + mm * N + rt * 32 + rr, y, mask=mm < M)
    if it > 0:
        mbarrier.arrive(empty.index(prev), count=1)


@gluon.jit
def skinny_gemm_swap(w_desc, x_ptr, y_ptr, M, K, N, NRT, KT, GK: gl.constexpr, MB: gl.constexpr, NB: gl.constexpr,
                     num_warps: gl.constexpr):
    """Swap-AB: the tile's chunk pairs are wgmma's 64-row A (from the ring slot, no copy), the tokens' chunks the
    narrow B (N = MB, M rounded up to 8), staged compactly ([MB, 32] bf16 a chunk; once for all row tiles when
    X fits GK column tiles). Pairing chunk 2q with chunk 2q + 1 as one A costs half the MMA work (each pair's
    product is used for one of its halves: even chunks into rows 0..31 of one accumulator, odd chunks into rows
    32..63 of another); one tile's wgmmas stay in flight while the next tile's issue."""
    bufs, empty, ready = _ring(w_desc, NB)
    xs = gl.allocate_shared_memory(gl.bfloat16, [GK * 8, MB, 32], gl.NVMMASharedLayout.get_default_for([MB, 32],
                                                                                                    gl.bfloat16))
    ys = gl.allocate_shared_memory(gl.float32, [64, MB], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    gl.warp_specialize([
        (_compute_swap, (x_ptr, y_ptr, M, K, N, NRT, KT, bufs, empty, ready, xs, ys, GK, MB, num_warps)),
        (_loader, (w_desc, bufs, empty, ready, NRT, KT, GK)),  # the tile order is row tile by row tile either way
    ], [1], [48])


def swap_plan(m: int, k: int, smem: int = 227 * 1024, slot: int = TR * TK * 2) -> tuple[int, int, int]:
    """(MB, GK, NB) of the swap-AB kernel for M tokens and K columns: MB = M rounded up to 8 (wgmma's N); X staged
    whole when it takes at most half of shared memory, else in groups of GK column tiles; the ring gets what the staging
    and the epilogue's [64, MB] fp32 buffer leave."""
    mb = max(8, -(-m // 8) * 8)
    kt = -(-k // TK)
    per_tile = mb * TK * 2
    gk = kt if kt * per_tile <= smem // 2 else max(1, (smem // 2) // per_tile)
    nb = min(16, (smem - gk * per_tile - 64 * mb * 4 - 1024) // slot)  # ring: what staging and the epilogue leave
    return mb, gk, nb


def run(w_tiles: torch.Tensor, x: torch.Tensor, n: int, k: int, gk: int = 2, nb: int = 8, grid: int | None = None,
        swap: bool = False):
    """Y [M, n] fp32 for x [M, k] fp32 and ``w_tiles`` (launch/pack.tile_major of W [n, k], viewed [*, 32]);
    ``swap``: the swap-AB kernel, its staging and ring sized by ``swap_plan``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    box = [TR * TK // 32, 32]
    desc = TensorDescriptor.from_tensor(w_tiles, box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))
    m = x.shape[0]
    y = torch.full((m, n), float("nan"), device=x.device)
    nrt, kt = n // TR, -(-k // TK)
    grid = grid or torch.cuda.get_device_properties(x.device).multi_processor_count
    if swap:
        mb, gk, nb = swap_plan(m, k)
        skinny_gemm_swap[(min(grid, nrt),)](desc, x, y, m, k, n, nrt, kt, GK=gk, MB=mb, NB=nb, num_warps=4)
    else:
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
            ref = x.to(torch.bfloat16).float() @ w.float().t()
            floor = n * k * 2 / bw * 1e3
            xb = x.to(torch.bfloat16)
            ms_t = triton.testing.do_bench(lambda: xb @ w.t(), return_mode="median")
            for swap in (False, True):
                y = run(tiles, x, n, k, swap=swap)
                err = float((y - ref).abs().max() / ref.abs().max())
                ms = triton.testing.do_bench(lambda: run(tiles, x, n, k, swap=swap), return_mode="median")
                rows.append((n, k, m, swap, err, ms, ms / floor, ms_t))
                print(f"N={n} K={k} M={m:2d} {'swap-AB' if swap else 'tokens-A'}: err {err:.1e}  {ms * 1e3:7.1f} us"
                      f"  {ms / floor:5.2f}x floor  torch {ms_t * 1e3:7.1f} us ({ms_t / floor:4.2f}x)", flush=True)


if __name__ == "__main__":
    main()
