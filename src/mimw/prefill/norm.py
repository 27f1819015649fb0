"""RMSNorm over rows, as the reference decoder computes it: the mean square and the scaling in fp32, the result
cast to the activation dtype *before* the weight multiply (Hugging Face's order), the product rounded once.

``rms_norm`` is the Triton kernel (one program per row); ``rms_norm_torch`` is the same on any device (it is the
reference decoder's own function).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..models.reference import rms_norm as rms_norm_torch

__all__ = ["rms_norm", "rms_norm_torch"]


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * r).to(Y.dtype.element_ty).to(tl.float32)  # rounded to the activation dtype first, as the reference
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (y * w).to(Y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] (last dim contiguous), w [D] -> [T, D] in x's dtype."""
    t, d = x.shape
    if x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("rms_norm needs rows with a contiguous last dimension")
    y = torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(t,)](x, w, y, x.stride(0), y.stride(0), d, eps, BLOCK_D=block,
                               num_warps=8 if block >= 4096 else 4)
    return y
