"""Paged KV cache layout, shared by the engine, the megakernel VM and the GPU kernel.

Storage: one pool per layer, every page holding ``page_size`` consecutive positions of one sequence for all KV
heads, stored head-major so that one (page, head) is a contiguous [page_size, head_dim] tile (one TMA box):

    k, v: [num_layers, num_pages, num_kv_heads, page_size, head_dim]            element type ``KVLayout.dtype``

A sequence owns a block table: the list of page ids holding its positions 0, page_size, 2*page_size, ...;
position p lives in page ``block_table[p // page_size]`` at row ``p % page_size``.

Element types: fp32 (the CPU oracle), bf16 / fp16, or fp8 e4m3 (``torch.float8_e4m3fn``). An fp8 pool carries one
scale per (token, KV head) row, beside the pages in tensors of their own:

    k_scale, v_scale: [num_layers, num_pages, num_kv_heads, page_size]          bf16, bf16(amax / 448) each

so the (page, head) tile [page_size, head_dim] has its scales in the contiguous [page_size] vector at the same
(layer, page, head) index. A reader dequantises row r of a tile as ``float(k[l, p, h, r, :]) * float(k_scale[l, p,
h, r])`` (exact in fp32: ``mimw.kv.fp8``). Writing a row sets its own scale and touches no other row,
so appending a token never rescales a page. Block tables and page arithmetic do not depend on the element type;
the scales travel with their page wherever a page goes (``PagedKVCache.page_tensors``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..models.spec import ModelSpec
from . import fp8

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, fp8.FP8)
KV_DTYPE_NAMES = {"auto": None, "bf16": torch.bfloat16, "fp8": fp8.FP8}  # --kv-dtype; auto: the backend's default


def parse_kv_dtype(name: str) -> torch.dtype | None:
    """A ``--kv-dtype`` value -> the pool's element type, or None for "auto" (the weights' dtype)."""
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {name!r}")
    return KV_DTYPE_NAMES[name]


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.num_pages <= 0:
            raise ValueError(f"page_size and num_pages must be positive, got {self.page_size}, {self.num_pages}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV element type must be one of {', '.join(map(str, KV_DTYPES))}, got {self.dtype}")

    @classmethod
    def for_spec(cls, spec: ModelSpec, page_size: int, num_pages: int, dtype: torch.dtype = torch.bfloat16):
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, num_pages, dtype)

    @property
    def quantized(self) -> bool:
        """True for fp8: the pools carry per-(token, head) scales."""
        return self.dtype == fp8.FP8

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, int, int, int]:
        return self.shape[:-1]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def bytes_per_token(self) -> int:
        """Bytes of one position across all layers and KV heads, K and V (scales included)."""
        row = self.head_dim * self.dtype.itemsize + (fp8.SCALE_DTYPE.itemsize if self.quantized else 0)
        return 2 * self.num_layers * self.num_kv_heads * row

    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers, K and V (scales included)."""
        return self.page_size * self.bytes_per_token()

    def describe(self) -> str:
        """E.g. "fp8 e4m3 + bf16 scale per (token, head)" or "bf16"."""
        if self.quantized:
            return "fp8 e4m3 + bf16 scale per (token, head)"
        return str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")


class PagedKVCache:
    """The page pools (``k``, ``v``, and for fp8 ``k_scale``, ``v_scale``) for one layout, plus slot arithmetic
    and the one place where K/V rows are quantised (``store``) and dequantised (``load``). Page allocation lives in
    the engine."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu"):
        self.layout = layout
        self.k = torch.zeros(layout.shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(layout.shape, dtype=layout.dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if layout.quantized:
            self.k_scale = torch.ones(layout.scale_shape, dtype=fp8.SCALE_DTYPE, device=device)
            self.v_scale = torch.ones(layout.scale_shape, dtype=fp8.SCALE_DTYPE, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.page_tensors())

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds per-page state, each laid out [num_layers, num_pages, ...]: what moves with a
        page between memory tiers (``mimw.kv.host_tier``): (k, v), and for fp8 (k, v, k_scale, v_scale) with the
        e4m3 pools as uint8 views of the same memory (a tier copies bytes, and index_copy_ and friends are not
        implemented for float8 on every device)."""
        if self.layout.quantized:
            return (self.k.view(torch.uint8), self.v.view(torch.uint8), self.k_scale, self.v_scale)
        return (self.k, self.v)

    def slots(self, block_table: Sequence[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, rows) for ``positions`` [T] of a sequence with ``block_table``."""
        ps = self.layout.page_size
        need = int(positions.max()) // ps + 1 if positions.numel() else 0
        if need > len(block_table):
            raise IndexError(f"position {int(positions.max())} needs {need} pages, block table has {len(block_table)}")
        bt = torch.as_tensor(list(block_table), dtype=torch.long, device=positions.device)
        return bt[positions // ps], positions % ps

    def store(self, name: str, layer: int, pages: torch.Tensor, rows: torch.Tensor, x: torch.Tensor,
              head: int | slice = slice(None)) -> None:
        """Store rows x [T, hd] (one ``head``) or [T, Hkv, hd] (``head`` = all) of pool ``name`` ("k" or "v") at
        (layer, pages[t], head, rows[t]): rounded to the pool's dtype, or quantised row by row for fp8."""
        pool = self.k if name == "k" else self.v
        if not self.layout.quantized:
            pool[layer, pages, head, rows] = x.to(pool.dtype)
            return
        q, scale = fp8.quantize(x)
        # through a byte view: index_put of float8 is not implemented on every device and torch version
        pool.view(torch.uint8)[layer, pages, head, rows] = q.view(torch.uint8)
        (self.k_scale if name == "k" else self.v_scale)[layer, pages, head, rows] = scale

    def load(self, name: str, layer: int, pages: torch.Tensor, rows: torch.Tensor,
             head: int | slice = slice(None)) -> torch.Tensor:
        """Rows [T, hd] or [T, Hkv, hd] of pool ``name`` (the shape ``store`` takes): the pool's dtype, or fp32
        dequantised (q * scale, exact) for fp8."""
        pool = self.k if name == "k" else self.v
        if not self.layout.quantized:
            return pool[layer, pages, head, rows]
        q = pool.view(torch.uint8)[layer, pages, head, rows].view(fp8.FP8)
        return fp8.dequantize(q, (self.k_scale if name == "k" else self.v_scale)[layer, pages, head, rows])

    def write(self, layer: int, block_table: Sequence[int], positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, hd] at ``positions`` [T]."""
        pages, rows = self.slots(block_table, positions)
        self.store("k", layer, pages, rows, k)
        self.store("v", layer, pages, rows, v)

    def gather(self, layer: int, block_table: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V for positions [0, length): each [length, Hkv, hd], in the pool's dtype (fp32 for fp8)."""
        pos = torch.arange(length, device=self.device)
        pages, rows = self.slots(block_table, pos)
        return self.load("k", layer, pages, rows), self.load("v", layer, pages, rows)
