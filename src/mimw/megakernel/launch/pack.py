"""Host-side weight packing for the megakernel: every streamed weight of the model in one tile array (tiles.py), in
the order and tile shape the plan streams them, plus the small vectors the instructions read. Done once per model;
the hot path never repacks.

  tiles [num_tiles * TR * TK / 32, 32] bf16   tile t = rows [t * TR * TK / 32, +TR * TK / 32): one [TR, TK]
                                             block stored chunk-major (its 32-column chunks one after the other,
                                             each TR rows; columns past K zero), read by one TMA load
  embed [V, D] bf16                           row-major: layer 0 reads one token's row
plus norms [L, D] (bf16), qkv bias [L, (Hq+2Hkv) hd] (fp32), q/k norm [L, hd], RoPE inv_freq.
MLP_IN's gate and up rows interleave in TR/2-row halves (``interleave_gate_up``), so one tile yields TR/2 outputs;
so do an expert's (EXPERT_IN). An MoE layer's router gets zero rows up to whole row tiles (tiles.router_rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models import rope
from ...models.weights import ModelWeights
from ..tiles import WeightTiles, router_rows


@dataclass
class PackedWeights:
    tiles: torch.Tensor
    embed: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    final_norm: torch.Tensor
    bias: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    inv_freq: torch.Tensor


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """[I, D] x 2 -> [2I, D] in TR-row tiles: tile j = gate rows [j*TR/2, (j+1)*TR/2) then up rows of the same
    range (TR = ``tile_rows``)."""
    i, d = gate.shape
    h = tile_rows // 2
    return torch.stack([gate.view(i // h, h, d), up.view(i // h, h, d)], dim=1).reshape(2 * i, d)


def tile_major(m: torch.Tensor, tile_rows: int, tile_k: int) -> torch.Tensor:
    """[R, K] -> [R/TR * KT, TK/FK * TR, FK] (FK = 32, or TK where it is smaller): tile (row tile r, column tile c)
    at index r*KT + c, one contiguous block stored chunk-major: its TK/FK chunks of FK columns one after the other,
    each the tile's TR rows of FK columns (row j*TR + i of the block = row i, columns [FK j, FK j + FK) of the tile).
    Columns past K (K not a multiple of TK) are zero."""
    r, k = m.shape
    kt = -(-k // tile_k)
    if kt * tile_k != k:
        m = torch.nn.functional.pad(m, (0, kt * tile_k - k))
    fk = min(32, tile_k)
    nf = tile_k // fk
    return m.reshape(r // tile_rows, tile_rows, kt, nf, fk).permute(0, 2, 3, 1, 4).reshape(-1, nf * tile_rows, fk)


def pack(w: ModelWeights, wt: WeightTiles, device: torch.device | str = "cuda") -> PackedWeights:
    spec = w.spec
    bf = dict(device=device, dtype=torch.bfloat16)
    tr, tk = wt.tile_rows, wt.tile_k
    tiles = torch.empty(wt.num_tiles, tr * tk // 32, 32, **bf)
    ep = router_rows(spec, tr)
    every, dense, moe = range(spec.num_layers), spec.mlp_layers, spec.moe_layers
    # (matrix, the layers it holds, each layer's blocks of rows in order): an MoE layer's experts one after the other
    per_layer = {"qkv": (every, lambda l: [torch.cat([l.wq, l.wk, l.wv])]), "o": (every, lambda l: [l.wo]),
                 "gu": (dense, lambda l: [interleave_gate_up(l.w_gate, l.w_up, tr)]),
                 "down": (dense, lambda l: [l.w_down]),
                 "router": (moe, lambda l: [torch.nn.functional.pad(l.router, (0, 0, 0, ep - l.router.shape[0]))]),
                 "egu": (moe, lambda l: (interleave_gate_up(l.e_gate[e], l.e_up[e], tr)
                                         for e in range(spec.num_experts))),
                 "edown": (moe, lambda l: (l.e_down[e] for e in range(spec.num_experts)))}
    for name, (layers, blocks) in per_layer.items():  # block by block into place: no whole-matrix temporaries
        t = wt[name].base
        for layer in layers:
            for block in blocks(w.layers[layer]):
                blk = tile_major(block.to(**bf), tr, tk)
                tiles[t: t + blk.shape[0]] = blk
                t += blk.shape[0]
    lm = wt["lm"]
    lm_tiles = tile_major((w.embed if w.lm_head is w.embed else w.lm_head).to(**bf), tr, tk)
    tiles[lm.base: lm.base + lm_tiles.shape[0]] = lm_tiles
    ls = w.layers
    if spec.attention_bias:
        bias = torch.stack([torch.cat([l.bq, l.bk, l.bv]) for l in ls]).to(device=device, dtype=torch.float32)
    else:
        bias = torch.zeros(1, device=device, dtype=torch.float32)
    if spec.qk_norm:
        qn = torch.stack([l.q_norm for l in ls]).to(**bf)
        kn = torch.stack([l.k_norm for l in ls]).to(**bf)
    else:
        qn = kn = torch.zeros(1, **bf)
    return PackedWeights(
        tiles=tiles.view(-1, 32),
        embed=w.embed.to(**bf),
        attn_norm=torch.stack([l.attn_norm for l in ls]).to(**bf),
        mlp_norm=torch.stack([l.mlp_norm for l in ls]).to(**bf),
        final_norm=w.final_norm.to(**bf),
        bias=bias,
        q_norm=qn,
        k_norm=kn,
        inv_freq=rope.inv_freq(spec).to(device),
    )
