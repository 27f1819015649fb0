"""The packed weight tile array: where every weight tile of a model lives, for the packer, the ops and the planner.

The megakernel streams these matrices, every layer's stacked in the order the loader walks them (Ld: the layers with
a dense MLP, all of a dense model's; Lm: an MoE model's MoE layers; E experts of F rows, Ep = E rounded up to whole
row tiles):

    qkv    [L * (Hq + 2 Hkv) * hd, D]   per layer: q heads, k heads, v heads
    o      [L * D, Hq * hd]
    gu     [Ld * 2 I, D]                per dense layer, TR/2 gate rows then the same TR/2 up rows, repeated (one
                                        TR-row tile yields TR/2 outputs of MLP_IN)
    down   [Ld * D, I]
    lm     [V, D]
    router [Lm * Ep, D]                 per MoE layer, the router's E rows, zero rows to Ep
    egu    [Lm * E * 2 F, D]            per MoE layer, per expert, its gate and up rows interleaved as in gu
    edown  [Lm * E * D, F]              per MoE layer, per expert, its down rows
An expert's tiles are contiguous and every expert of a matrix has as many, so expert e's block of rows of layer m is
expert 0's moved by e * ``expert_stride`` tiles: the expert spans of isa.py. A dense model's MoE matrices are empty.
Each is cut into [tile_rows, tile_k] tiles (columns past K zero, as TMA fills them) stored tile-major: tile (row tile
R, column tile c) of a matrix with KT column tiles is the contiguous block number ``base + R * KT + c`` of one
array, so every TMA load reads 16 contiguous kilobytes and one descriptor addresses every tile. ``span`` names the
tiles of a block of rows (isa.TileSpan); host/pack.py writes the array in this order.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models.spec import ModelSpec
from .isa import TileSpan

MATRICES = ("qkv", "o", "gu", "down", "lm", "router", "egu", "edown")
EXPERT_MATRICES = {"egu": "the expert gate/up", "edown": "the expert down"}


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

    num_experts: int = 0
    num_moe_layers: int = 0

    @classmethod
    def for_spec(cls, spec: ModelSpec, tile_rows: int, tile_k: int) -> "WeightTiles":
        L, d, i = spec.num_layers, spec.hidden_size, spec.intermediate_size
        ld, lm, e, f = len(spec.mlp_layers), len(spec.moe_layers), spec.num_experts, spec.moe_intermediate_size
        shapes = {"qkv": (L * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, d),
                  "o": (L * d, spec.q_size), "gu": (ld * 2 * i, d), "down": (ld * d, i),
                  "lm": (spec.vocab_size, d), "router": (lm * router_rows(spec, tile_rows), d),
                  "egu": (lm * e * 2 * f, d), "edown": (lm * e * d, f)}
        if lm and (2 * f % tile_rows or d % tile_rows):
            raise ValueError(f"an expert's gate/up ({2 * f} rows) and down ({d} rows) must be whole {tile_rows}-row "
                             "tiles")
        out, base = [], 0
        for name in MATRICES:
            rows, cols = shapes[name]
            if rows % tile_rows:
                raise ValueError(f"{name}: {rows} rows are not whole {tile_rows}-row tiles")
            kt = -(-cols // tile_k)
            out.append((name, Matrix(base, rows, cols, kt)))
            base += rows // tile_rows * kt
        return cls(tile_rows, tile_k, tuple(out), e, lm)

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

    def expert_stride(self, name: str) -> int:
        """Tiles of one expert in expert matrix ``name`` (egu, edown): its rows of one MoE layer, whole tiles."""
        m = self[name]
        if name not in EXPERT_MATRICES or not self.num_experts:
            raise ValueError(f"{name} is not an expert matrix of this model")
        return m.rows // self.num_moe_layers // self.num_experts // self.tile_rows * m.kt

    def expert_span(self, name: str, moe_layer: int, row0: int, nrows: int) -> TileSpan:
        """The expert span (isa.EXPERT_SPAN) of rows [row0, row0 + nrows) of one expert of ``moe_layer`` (the
        layer's ordinal among the MoE layers) in ``name``: expert 0's tiles, and the stride to expert e's."""
        xs = self.expert_stride(name)
        per_expert = self[name].rows // self.num_moe_layers // self.num_experts
        t = self.span(name, moe_layer * self.num_experts * per_expert + row0, nrows)
        return TileSpan(t.t0, t.nr, t.k0, t.k1, t.kt, xs)


def router_rows(spec: ModelSpec, tile_rows: int) -> int:
    """Ep: the router's rows of one MoE layer in the tile array, E rounded up to whole row tiles."""
    return -(-spec.num_experts // tile_rows) * tile_rows


def column_tiles(k: int, tile_k: int, part: int, n_parts: int) -> tuple[int, int]:
    """Column tiles [t0, t1) of part ``part`` of ``n_parts`` over k columns, as even as whole tiles allow."""
    kt = -(-k // tile_k)
    return part * kt // n_parts, (part + 1) * kt // n_parts


def column_part(k: int, tile_k: int, part: int, n_parts: int) -> tuple[int, int]:
    """Columns [c0, c1) of part ``part`` of ``n_parts`` over k columns (``column_tiles`` in columns)."""
    t0, t1 = column_tiles(k, tile_k, part, n_parts)
    return min(k, t0 * tile_k), min(k, t1 * tile_k)
