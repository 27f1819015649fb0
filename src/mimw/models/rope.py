"""Rotary position embedding tables, computed exactly as Hugging Face transformers does (fp32 throughout).

Convention (HF ``rotate_half``): within a head, element i pairs with element i + head_dim/2 for i < head_dim/2:
  out[i]        = x[i] * cos[i] - x[i + h] * sin[i]
  out[i + h]    = x[i + h] * cos[i] + x[i] * sin[i]
"""
from __future__ import annotations

import math

import torch

from .spec import LinearRopeScaling, ModelSpec


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies, with the spec's scaling (linear or llama3) applied."""
    hd = spec.head_dim
    f = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = spec.rope_scaling
    if rs is None:
        return f
    if isinstance(rs, LinearRopeScaling):
        return f / rs.factor
    old = rs.original_max_position_embeddings
    low_wl, high_wl = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / f
    scaled = torch.where(wavelen > low_wl, f / rs.factor, f)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


def cos_sin(spec: ModelSpec, positions: torch.Tensor, device: torch.device | str | None = None):
    """cos, sin: [T, head_dim/2] fp32 for integer ``positions`` [T]."""
    f = inv_freq(spec).to(device if device is not None else positions.device)
    ang = positions.to(f.device).float()[:, None] * f[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, hd]; cos/sin: [T, hd/2] fp32. Computes in fp32 and returns x's dtype."""
    h = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., :h], xf[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1).to(x.dtype)
