"""SwiGLU's activation on the fused gate/up GEMM's output: silu(gate) * up, in fp32, rounded once to the
activation dtype (the reference rounds silu(gate) first; the difference is one rounding of a bf16 value).

``silu_mul`` is the Triton kernel; ``silu_mul_torch`` the same on any device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(GU, OUT, I, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(GU + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + I + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate columns, then up) -> [T, I]."""
    t, two_i = gu.shape
    if gu.stride(1) != 1:
        raise ValueError("silu_mul needs rows with a contiguous last dimension")
    i = two_i // 2
    out = torch.empty(t, i, dtype=gu.dtype, device=gu.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(i, BLOCK))](gu, out, i, gu.stride(0), out.stride(0), BLOCK=BLOCK,
                                                     num_warps=4)
    return out


def silu_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gu.dtype)
