"""FP8 (e4m3) rows with power-of-two scales: the element format of an fp8 KV cache.

A row is one token's vector of one KV head (``head_dim`` values). Quantising a row:

    amax  = max_i |x_i|
    scale = 2 ** ceil(log2(amax / 448))          (1 when amax == 0; 448 = the largest finite e4m3 value)
    q_i   = e4m3(x_i / scale)                    (round to nearest even; |x_i / scale| <= 448 by construction)

and dequantising is ``x_i ~= float(q_i) * scale``. Why a power of two:
  * ``x / scale`` is exact, so the e4m3 rounding is the only error (relative error <= 2^-4 for normal values);
  * ``float(q) * scale`` is exact in bf16 as well as fp32 (e4m3 has 4 significant bits, bf16 has 8, and a power of
    two only moves the exponent), so a reader may dequantise to bf16 and feed bf16 tensor cores without a second
    rounding, and a bf16 oracle holding the dequantised values computes what an fp8 reader computes;
  * re-quantising dequantised values gives them back unchanged (a page copied through bf16 survives);
  * the cost against an exact ``amax / 448`` scale is nil in precision: e4m3 is a floating-point format, so where
    the row's largest value lands in (224, 448] instead of at 448 changes no element's relative precision (only
    the subnormal floor, 2^-9 * scale, moves by one binade). bench/NOTES.md has the measured comparison.

Scales are stored in bf16 (exact for a power of two; 2 bytes a row). The exponent is clamped to bf16's normal range.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_DTYPE = torch.bfloat16
_MIN_EXP, _MAX_EXP = -126, 127  # bf16's (and fp32's) normal exponents


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s <= 448, as fp32 (same shape as ``amax``); 1 where amax == 0."""
    m, e = torch.frexp(amax.float() / E4M3_MAX)  # x = m * 2^e, m in [0.5, 1): ceil(log2 x) = e, or e - 1 at m == 0.5
    e = (e - (m == 0.5).to(e.dtype)).clamp(_MIN_EXP, _MAX_EXP)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q [..., n] e4m3, scale [...] bf16), one power-of-two scale per row (the last dimension)."""
    xf = x.float()
    scale = pow2_scale(xf.abs().amax(-1))
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale.to(SCALE_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., n] e4m3, scale [...] -> q * scale [..., n] in ``dtype`` (exact in fp32 and bf16)."""
    return (q.float() * scale.float()[..., None]).to(dtype)
