"""The KV element formats ``mimw bench kv-accuracy`` compares, each as a cache the reference decoder runs over.

The real formats are ``PagedKVCache`` itself at fp32, bf16 or fp8 (``fp8-token``, ``mimw.kv.fp8``: e4m3 with a bf16
scale amax / 448 per (token, KV head)). The other candidates exist only here, as *simulated* caches: an fp32 pool
holding what the format would hand a reader (the values quantised to e4m3 with that format's scales, then
dequantised), so the decoder's arithmetic is the same and only the stored values differ:

  fp8-token-f32    per (token, head), scale amax / 448 kept in fp32 (is bf16's rounding of the scale visible?)
  fp8-token-pow2   per (token, head), scale 2^ceil(log2(amax / 448)): q * scale exact in bf16, but the row's
                   largest element lands anywhere in (224, 448] instead of on 448
  fp8-page         per (page, head): one scale, bf16(amax / 448), for a [page_size, head_dim] tile, from the amax
                   over the rows written so far (in a prefill chunk, the whole chunk's rows), every row of the page
                   re-quantised from its original value whenever the page's scale changes; the best a per-page
                   format can do, since a real one re-quantises already-rounded rows (or clips a row larger than
                   the page's scale)
  fp8-static-1     per (layer, head), fixed scale 1.0 (what engines use for checkpoints without KV scales)
  fp8-static-cal   per (layer, head), scale = amax over a calibration text / 448; larger values clip at +-448
and three formats that are not plain e4m3 per row, measured to show where the error comes from and what would
reduce it:
  fp8-v-only       K kept in bf16, V as fp8-token (1.33x the tokens of bf16 instead of 2x)
  fp8-hadamard     fp8-token after rotating every K and V row by the orthonormal Hadamard matrix H [hd, hd] (a reader
                   would rotate q by H after RoPE and o back by H^T, or fold H into W_v / W_o): outlier channels that
                   q and k share get spread over all channels
  int8-token       per (token, head) symmetric int8, scale = amax / 127 (8 significant bits instead of e4m3's 4)
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..kv import fp8
from ..kv.pages import KVLayout, PagedKVCache

Amax = dict[str, torch.Tensor]  # "k" / "v" -> [num_layers, num_kv_heads] calibration amax


def _round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., hd] through e4m3 with ``scale`` (broadcast against x [..., 1]) and back, in fp32."""
    s = scale.float()
    return (x.float() / s).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.FP8).float() * s


def _token_fp8(x: torch.Tensor) -> torch.Tensor:
    return fp8.dequantize(*fp8.quantize(x))


def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (n a power of two)."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _int8_token(x: torch.Tensor) -> torch.Tensor:
    s = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127.0
    return (x.float() / s).round().clamp(-127, 127) * s


class SimulatedCache(PagedKVCache):
    """An fp32 ``PagedKVCache`` whose ``store`` keeps what a format would hand a reader: ``values(name, layer, x
    [T, Hkv, hd]) -> [T, Hkv, hd]``."""

    def __init__(self, layout: KVLayout, values: Callable[[str, int, torch.Tensor], torch.Tensor],
                 device: torch.device | str = "cpu"):
        super().__init__(KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size,
                                  layout.num_pages, torch.float32), device)
        self.values = values

    def store(self, name, layer, pages, rows, x, head=slice(None)) -> None:
        super().store(name, layer, pages, rows, self.values(name, layer, x), head)


def with_scales(scale_of: Callable[[str, int, torch.Tensor], torch.Tensor]):
    """values() of an e4m3 format whose scales ``scale_of(name, layer, x)`` broadcast against x."""
    return lambda name, layer, x: _round_trip(x, scale_of(name, layer, x))


class PageScaleCache(PagedKVCache):
    """fp8-page (see the module docstring): an fp32 shadow of the original rows, and the visible pool re-quantised
    per (page, head) tile after every write."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu"):
        super().__init__(KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size,
                                  layout.num_pages, torch.float32), device)
        self.shadow = {"k": torch.zeros_like(self.k), "v": torch.zeros_like(self.v)}

    def store(self, name, layer, pages, rows, x, head=slice(None)) -> None:
        orig = self.shadow[name]
        orig[layer, pages, head, rows] = x.float()
        touched = torch.unique(pages)
        tiles = orig[layer, touched]  # [n, Hkv, ps, hd]; unwritten rows are 0 and leave the amax alone
        scale = fp8.row_scale(tiles.abs().amax(dim=(-2, -1)))[..., None, None]  # [n, Hkv, 1, 1]
        (self.k if name == "k" else self.v)[layer, touched] = _round_trip(tiles, scale)


def token_f32_scale(name: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    amax = x.float().abs().amax(-1, keepdim=True)
    return torch.where(amax > 0, amax / fp8.E4M3_MAX, torch.ones_like(amax))


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s <= 448 (fp32, amax's shape); 1 where amax == 0."""
    m, e = torch.frexp(amax.float() / fp8.E4M3_MAX)  # x = m * 2^e, m in [0.5, 1): ceil(log2 x) = e, or e - 1 at 0.5
    e = torch.where(amax > 0, (e - (m == 0.5).to(e.dtype)).clamp(-126, 127), torch.zeros_like(e))
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e)


def token_pow2_scale(name: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    return pow2_scale(x.float().abs().amax(-1, keepdim=True))


def static_scale(amax: Amax | None) -> Callable[[str, int, torch.Tensor], torch.Tensor]:
    """Per (layer, head) scales: 1.0 everywhere when ``amax`` is None, else amax / 448 from the calibration."""
    def scale_of(name: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        if amax is None:
            return torch.ones((x.shape[-2], 1))
        a = amax[name][layer].float()
        return torch.where(a > 0, a / fp8.E4M3_MAX, torch.ones_like(a))[:, None]  # [Hkv, 1]
    return scale_of


class AmaxRecorder(PagedKVCache):
    """A plain cache that also records the largest |K| and |V| per (layer, KV head) ever stored (calibration)."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu"):
        super().__init__(layout, device)
        shape = (layout.num_layers, layout.num_kv_heads)
        self.amax: Amax = {"k": torch.zeros(shape), "v": torch.zeros(shape)}

    def store(self, name, layer, pages, rows, x, head=slice(None)) -> None:
        a = x.float().abs().amax(dim=(0, -1)).cpu()  # [Hkv]
        self.amax[name][layer] = torch.maximum(self.amax[name][layer], a)
        super().store(name, layer, pages, rows, x, head)


VARIANTS: Sequence[str] = ("fp32", "bf16", "fp8-token", "fp8-token-f32", "fp8-token-pow2", "fp8-page",
                           "fp8-static-1", "fp8-static-cal", "fp8-v-only", "fp8-hadamard", "int8-token")


def make_cache(variant: str, layout: KVLayout, calibration: Amax | None = None,
               device: torch.device | str = "cpu") -> PagedKVCache:
    """A cache of ``layout``'s shape holding ``variant``'s values (``layout.dtype`` is ignored)."""
    shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, layout.num_pages)
    real = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8-token": fp8.FP8}
    if variant in real:
        return PagedKVCache(KVLayout(*shape, real[variant]), device)
    if variant == "fp8-token-f32":
        return SimulatedCache(layout, with_scales(token_f32_scale), device)
    if variant == "fp8-token-pow2":
        return SimulatedCache(layout, with_scales(token_pow2_scale), device)
    if variant == "fp8-page":
        return PageScaleCache(layout, device)
    if variant == "fp8-static-1":
        return SimulatedCache(layout, with_scales(static_scale(None)), device)
    if variant == "fp8-static-cal":
        if calibration is None:
            raise ValueError("fp8-static-cal needs calibration amax values")
        return SimulatedCache(layout, with_scales(static_scale(calibration)), device)
    if variant == "fp8-v-only":
        return SimulatedCache(layout, lambda n, _, x: _token_fp8(x) if n == "v" else x.bfloat16().float(), device)
    if variant == "fp8-hadamard":
        h = _hadamard(layout.head_dim).to(device)
        return SimulatedCache(layout, lambda n, _, x: _token_fp8(x.float() @ h.T) @ h, device)
    if variant == "int8-token":
        return SimulatedCache(layout, lambda n, _, x: _int8_token(x), device)
    raise ValueError(f"unknown KV variant {variant!r}; known: {', '.join(VARIANTS)}")
