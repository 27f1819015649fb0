"""Host-side weight packing for the megakernel: one bf16 matrix per weight kind, all layers stacked, in the row
order the loader streams (plans once per model; the hot path never repacks).

  qkv  [L * (Hq + 2 Hkv) * hd, D]   per layer: q heads, k heads, v heads (ATTN_IN head h = rows h*hd ..)
  o    [L * D, Hq * hd]
  gu   [L * 2I, D]                  per layer, TR/2 gate rows then the same TR/2 up rows, repeated: one
                                   TR-row tile yields TR/2 outputs of MLP_IN
  down [L * D, I]
  lm   [V, D]                       the LM head (the embedding table itself when embeddings are tied)
plus the small vectors: norms [L, D] (bf16), qkv bias [L, (Hq+2Hkv) hd] (fp32), q/k norm [L, hd], RoPE inv_freq.

With ``tile_k`` given, the five streamed matrices are stored tile-major (``tile_major``): every [TR, TK] weight tile
is one contiguous 16 KB block, so a TMA load reads consecutive bytes (DRAM pages stay open) instead of TR runs of
TK elements a whole row apart. The embedding table stays row-major (layer 0 reads one row of it); a tied LM head
then gets its own tile-major copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models import rope
from ...models.weights import ModelWeights


@dataclass
class PackedWeights:
    qkv: torch.Tensor
    o: torch.Tensor
    gu: torch.Tensor
    down: torch.Tensor
    lm: torch.Tensor
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
    """[R, K] -> [R/TR * KT * TR, TK]: tile (row tile r, column tile c) becomes rows [(r*KT + c)*TR, +TR), i.e. one
    contiguous block; columns past K (K not a multiple of TK) are zero, as TMA fills them for a row-major matrix."""
    r, k = m.shape
    kt = -(-k // tile_k)
    if kt * tile_k != k:
        m = torch.nn.functional.pad(m, (0, kt * tile_k - k))
    return m.view(r // tile_rows, tile_rows, kt, tile_k).permute(0, 2, 1, 3).reshape(-1, tile_k).contiguous()


def pack(w: ModelWeights, tile_rows: int, device: torch.device | str = "cuda",
         tile_k: int | None = None) -> PackedWeights:
    spec = w.spec
    bf = dict(device=device, dtype=torch.bfloat16)
    ls = w.layers
    cat = lambda ts: torch.cat([t.to(**bf) for t in ts])  # noqa: E731
    qkv = cat([torch.cat([l.wq, l.wk, l.wv]) for l in ls])
    if spec.attention_bias:
        bias = torch.stack([torch.cat([l.bq, l.bk, l.bv]) for l in ls]).to(device=device, dtype=torch.float32)
    else:
        bias = torch.zeros(1, device=device, dtype=torch.float32)
    if spec.qk_norm:
        qn = torch.stack([l.q_norm for l in ls]).to(**bf)
        kn = torch.stack([l.k_norm for l in ls]).to(**bf)
    else:
        qn = kn = torch.zeros(1, **bf)
    embed = w.embed.to(**bf)
    lm = embed if w.lm_head is w.embed else w.lm_head.to(**bf)
    o = cat([l.wo for l in ls])
    gu = cat([interleave_gate_up(l.w_gate, l.w_up, tile_rows) for l in ls])
    down = cat([l.w_down for l in ls])
    if tile_k:
        qkv, o, gu, down, lm = (tile_major(m, tile_rows, tile_k) for m in (qkv, o, gu, down, lm))
    return PackedWeights(
        qkv=qkv,
        o=o,
        gu=gu,
        down=down,
        lm=lm,
        embed=embed,
        attn_norm=torch.stack([l.attn_norm for l in ls]).to(**bf),
        mlp_norm=torch.stack([l.mlp_norm for l in ls]).to(**bf),
        final_norm=w.final_norm.to(**bf),
        bias=bias,
        q_norm=qn,
        k_norm=kn,
        inv_freq=rope.inv_freq(spec).to(device),
    )
