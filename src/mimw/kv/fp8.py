"""FP8 (e4m3) rows with one bf16 scale each: the element format of an fp8 KV cache.

A row is one token's vector of one KV head (``head_dim`` values). Quantising a row:

    amax  = max_i |x_i|
    scale = bf16(amax / 448)                     (round to nearest; 1 when amax == 0; 448 = largest finite e4m3)
    q_i   = e4m3(clamp(x_i / scale, -448, 448))  (round to nearest even)

and dequantising is ``x_i ~= float(q_i) * float(scale)``, exact in fp32 (4 significant bits times 8). The row's
largest element lands on 448 (within the scale's bf16 rounding), so it comes back almost exactly: K rows are
dominated by a few large channels that queries share, and that element's exactness is measurable (bench/NOTES.md:
a power-of-two scale, which makes ``q * scale`` exact in bf16 but puts the largest element anywhere in (224, 448],
raised the mean KL against bf16 KV by ~50% on the default model). Re-quantising dequantised fp32 values gives them
back unchanged, so a page copied through fp32 survives bit for bit.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_DTYPE = torch.bfloat16
_MIN_SCALE = 2.0 ** -126  # bf16's smallest normal: a tiny nonzero row must not get a zero scale


def row_scale(amax: torch.Tensor) -> torch.Tensor:
    """bf16 scales (same shape as ``amax``): amax / 448 rounded to bf16, 1 where amax == 0."""
    s = (amax.float() / E4M3_MAX).clamp_min(_MIN_SCALE)
    return torch.where(amax > 0, s, torch.ones_like(s)).to(SCALE_DTYPE)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q [..., n] e4m3, scale [...] bf16), one scale per row (the last dimension)."""
    xf = x.float()
    scale = row_scale(xf.abs().amax(-1))
    q = (xf / scale.float()[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., n] e4m3, scale [...] -> q * scale [..., n], computed in fp32 (exact), returned in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)
