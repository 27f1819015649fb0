"""Paged KV cache layout, shared by the engine, the megakernel VM and the GPU kernel.

Storage: one pool per layer, every page holding ``page_size`` consecutive positions of one sequence for all KV
heads, stored head-major so that one (page, head) is a contiguous [page_size, head_dim] tile (one TMA box):

    k, v: [num_layers, num_pages, num_kv_heads, page_size, head_dim]

A sequence owns a block table: the list of page ids holding its positions 0, page_size, 2*page_size, ...;
position p lives in page ``block_table[p // page_size]`` at row ``p % page_size``.

The element type is a parameter of ``KVLayout``. bf16 (or fp32 for the CPU oracle) today; an fp8 (e4m3) variant adds
per-(layer, page, head) scales beside the same page shape without changing block tables or page math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..models.spec import ModelSpec


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

    @classmethod
    def for_spec(cls, spec: ModelSpec, page_size: int, num_pages: int, dtype: torch.dtype = torch.bfloat16):
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, num_pages, dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * self.head_dim * elem


class PagedKVCache:
    """The page pools (``k``, ``v``) for one layout, plus slot arithmetic. Page allocation lives in the engine."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu"):
        self.layout = layout
        self.k = torch.zeros(layout.shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(layout.shape, dtype=layout.dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds per-page state, each laid out [num_layers, num_pages, ...]: what moves with a
        page between memory tiers (``mimw.kv.host_tier``), so that a layout adding per-page data (scales) adds it
        here and the tier moves it too."""
        return (self.k, self.v)

    def slots(self, block_table: Sequence[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, rows) for ``positions`` [T] of a sequence with ``block_table``."""
        ps = self.layout.page_size
        need = int(positions.max()) // ps + 1 if positions.numel() else 0
        if need > len(block_table):
            raise IndexError(f"position {int(positions.max())} needs {need} pages, block table has {len(block_table)}")
        bt = torch.as_tensor(list(block_table), dtype=torch.long, device=positions.device)
        return bt[positions // ps], positions % ps

    def write(self, layer: int, block_table: Sequence[int], positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, hd] at ``positions`` [T]."""
        pages, rows = self.slots(block_table, positions)
        self.k[layer, pages, :, rows] = k.to(self.layout.dtype)
        self.v[layer, pages, :, rows] = v.to(self.layout.dtype)

    def gather(self, layer: int, block_table: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V for positions [0, length): each [length, Hkv, hd]."""
        pos = torch.arange(length, device=self.device)
        pages, rows = self.slots(block_table, pos)
        return self.k[layer, pages, :, rows], self.v[layer, pages, :, rows]
