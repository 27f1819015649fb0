"""The packed weight tile array: where every weight tile of a model lives, for the packer, the ops and the planner.

The megakernel streams five matrices, every layer's stacked in the order the loader walks them:

    qkv   [L * (Hq + 2 Hkv) * hd, D]   per layer: q heads, k heads, v heads
    o     [L * D, Hq * hd]
    gu    [L * 2 I, D]                 per layer, TR/2 gate rows then the same TR/2 up rows, repeated (one
                                       TR-row tile yields TR/2 outputs of MLP_IN)
    down  [L * D, I]
    lm    [V, D]
Each is cut into [tile_rows, tile_k] tiles (columns past K zero, as TMA fills them) stored tile-major: tile (row tile
R, column tile c) of a matrix with KT column tiles is the contiguous block number ``base + R * KT + c`` of one
array, so every TMA load reads 16 contiguous kilobytes and one descriptor addresses every tile. ``span`` names the
tiles of a block of rows (isa.TileSpan); host/pack.py writes the array in this order.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models.spec import ModelSpec
from .isa import TileSpan

MATRICES = ("qkv", "o", "gu", "down", "lm")


@dataclass(frozen=True)
class Matrix:
    base: int  # number of its first tile in the array
    rows: int
    cols: int
    kt: int  # column tiles per row tile


@dataclass(frozen=True)
class WeightTiles:
    tile_rows: int
    tile_k: int
    matrices: tuple[tuple[str, Matrix], ...]

    @classmethod
    def for_spec(cls, spec: ModelSpec, tile_rows: int, tile_k: int) -> "WeightTiles":
        L, d, i = spec.num_layers, spec.hidden_size, spec.intermediate_size
        shapes = {"qkv": (L * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, d),
                  "o": (L * d, spec.q_size), "gu": (L * 2 * i, d), "down": (L * d, i),
                  "lm": (spec.vocab_size, d)}
        out, base = [], 0
        for name in MATRICES:
            rows, cols = shapes[name]
            if rows % tile_rows:
                raise ValueError(f"{name}: {rows} rows are not whole {tile_rows}-row tiles")
            kt = -(-cols // tile_k)
            out.append((name, Matrix(base, rows, cols, kt)))
            base += rows // tile_rows * kt
        return cls(tile_rows, tile_k, tuple(out))

    def __getitem__(self, name: str) -> Matrix:
        return dict(self.matrices)[name]

    @property
    def num_tiles(self) -> int:
        m = self.matrices[-1][1]
        return m.base + m.rows // self.tile_rows * m.kt

    @property
    def tile_bytes(self) -> int:
        return self.tile_rows * self.tile_k * 2

    def span(self, name: str, row0: int, nrows: int, k0: int = 0, k1: int | None = None) -> TileSpan:
        """Rows [row0, row0 + nrows) of matrix ``name`` (whole tiles), column tiles [k0, k1) (default: all)."""
        m, tr = self[name], self.tile_rows
        if row0 % tr or nrows % tr:
            raise ValueError(f"{name} rows [{row0}, {row0 + nrows}) are not whole {tr}-row tiles")
        return TileSpan(m.base + row0 // tr * m.kt, nrows // tr, k0, m.kt if k1 is None else k1, m.kt)


def column_tiles(k: int, tile_k: int, part: int, n_parts: int) -> tuple[int, int]:
    """Column tiles [t0, t1) of part ``part`` of ``n_parts`` over k columns, as even as whole tiles allow."""
    kt = -(-k // tile_k)
    return part * kt // n_parts, (part + 1) * kt // n_parts


def column_part(k: int, tile_k: int, part: int, n_parts: int) -> tuple[int, int]:
    """Columns [c0, c1) of part ``part`` of ``n_parts`` over k columns (``column_tiles`` in columns)."""
    t0, t1 = column_tiles(k, tile_k, part, n_parts)
    return min(k, t0 * tile_k), min(k, t1 * tile_k)
