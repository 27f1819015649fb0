"""Streaming-read bandwidth: the denominator of the floor, measured in the same run as the backends.

A read-only Triton kernel sums a >= 4 GiB buffer (far beyond the 60 MB L2, so every byte comes from HBM); each
program reads ``ITERS`` consecutive ``BLOCK``-element tiles and writes one fp32 partial sum (negligible writes).
A handful of tile shapes are tried and the best median is kept: the floor should use the best streaming rate the
chip reaches, not the rate of one arbitrary launch configuration. ``torch.sum`` over the same buffer is measured
too, as a sanity figure (it should land a few percent below).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

GiB = 1 << 30


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@dataclass(frozen=True)
class ReadBandwidth:
    bytes_per_s: float          # best median over the tried configurations
    nbytes: int
    config: str                 # the winning "BLOCK=.. ITERS=.. warps=.."
    torch_sum_bytes_per_s: float

    @property
    def tbps(self) -> float:
        return self.bytes_per_s / 1e12

    def to_json(self) -> dict:
        return {**asdict(self), "TBps": self.tbps}


def _median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


def measure_read_bandwidth(nbytes: int = 4 * GiB, reps: int = 15,
                           configs: tuple[tuple[int, int, int], ...] = ((4096, 8, 8), (8192, 4, 8), (2048, 16, 4),
                                                                        (4096, 16, 16))) -> ReadBandwidth:
    """Best streaming-read rate over ``configs`` (BLOCK fp32 elements, ITERS tiles per program, num_warps)."""
    n = nbytes // 4
    x = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    best, best_cfg, errors = 0.0, "", []
    for block, iters, warps in configs:
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, dtype=torch.float32, device="cuda")
        try:
            ms = _median_ms(lambda: _read_kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps), reps)
        except Exception as e:  # noqa: BLE001 - e.g. a config the compiler rejects; the others still count
            errors.append(f"{type(e).__name__}: {e}"[:120])
            continue
        rate = n * 4 / (ms * 1e-3)
        if rate > best:
            best, best_cfg = rate, f"BLOCK={block} ITERS={iters} warps={warps}"
    sum_ms = _median_ms(lambda: x.sum(), reps)
    if best == 0.0:  # no Triton config ran: fall back to torch.sum, and say so
        best, best_cfg = n * 4 / (sum_ms * 1e-3), f"torch.sum fallback (triton failed: {errors[0]})"
    del x
    torch.cuda.empty_cache()
    return ReadBandwidth(best, n * 4, best_cfg, n * 4 / (sum_ms * 1e-3))
