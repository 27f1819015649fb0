"""ATTN_IN: one column part of one q, k or v head of one layer, for every token of the step; the last part of the
head to run finishes it (isa.py: tickets).

Head index convention (isa.py): 0..Hq-1 query heads, Hq..Hq+Hkv-1 key heads, Hq+Hkv..Hq+2*Hkv-1 value heads.

solve (every part):
    x   [M, D]   residual stream entering the layer (layer 0: the embedding rows weights.embed[tokens])
    h   [M, D]   = RMSNorm(x) * attn_norm                         (rounded to the weight dtype, see common.py)
    qkv_part[part] [M, hd] = h[:, cols] . W[head rows, cols]^T,  cols = program.column_part(D, tile_k, part, n_parts)
finish (the last part; with isa.QKV_IN_ATTN nobody here: each ATTN_PARTIAL runs finish_rows for its own heads):
    y   [M, hd]  = sum of qkv_part[0..n_parts-1] in part order (+ bias rows, qwen2)
    q/k heads:   y = RMSNorm(y) * q_norm / k_norm  (qwen3, per head)  then RoPE at each token's position
                 (rope.cos_sin, HF rotate_half pairing: element i pairs with i + hd/2)
    v heads:     bias only
    writes: q head -> scratch.q[:, head, :]  [M, hd] fp32;
            k/v head -> cache.k / cache.v [layer, page, kv_head, row, :] in the cache dtype, with
            page = block_tables[seg(m)][pos_m // page_size], row = pos_m % page_size.
Reads:  x (all of it: the norm needs the whole row) or the embedding rows; the layer's weights; tokens, positions
        and block tables from the step state.
"""
from __future__ import annotations

import torch

from ...models import rope
from ..isa import AttnIn
from ..program import column_part
from .common import OpContext, matvec, residual, rms_norm


def _head(ctx: OpContext, ins: AttnIn):
    spec, lw = ctx.spec, ctx.weights.layers[ins.layer]
    hq, hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    kind, idx = ("q", ins.head) if ins.head < hq else (("k", ins.head - hq) if ins.head < hq + hkv
                                                       else ("v", ins.head - hq - hkv))
    w, b = {"q": (lw.wq, lw.bq), "k": (lw.wk, lw.bk), "v": (lw.wv, lw.bv)}[kind]
    return kind, idx, w, b, slice(idx * hd, (idx + 1) * hd)


def solve(ctx: OpContext, ins: AttnIn) -> None:
    spec, lw = ctx.spec, ctx.weights.layers[ins.layer]
    _, _, w, _, rows = _head(ctx, ins)
    c0, c1 = column_part(spec.hidden_size, ctx.program.config.tile_k, ins.part, ins.n_parts)
    h = rms_norm(residual(ctx, ins.layer), lw.attn_norm, spec.rms_norm_eps)  # [M, D]
    ctx.scratch.qkv_part[ins.part, :, ins.head] = matvec(h[:, c0:c1], w[rows, c0:c1])  # [M, hd]


def finish_rows(ctx: OpContext, layer: int, head: int, n_parts: int) -> torch.Tensor:
    """y [M, hd] of one head: its n_parts column parts summed in part order (+bias) (+q/k RMSNorm) (+RoPE for q
    and k heads), the finisher's math, for every token of the step. ATTN_IN's finisher stores it; with
    isa.QKV_IN_ATTN each ATTN_PARTIAL computes its own heads' (ops/attn_partial.py)."""
    spec, lw = ctx.spec, ctx.weights.layers[layer]
    kind, _, _, b, rows = _head(ctx, AttnIn(layer=layer, head=head))
    y = ctx.scratch.qkv_part[0, :, head]
    for p in range(1, n_parts):
        y = y + ctx.scratch.qkv_part[p, :, head]
    if b is not None:
        y = y + b[rows].float()
    if kind != "v":
        if spec.qk_norm:
            y = rms_norm(y, lw.q_norm if kind == "q" else lw.k_norm, spec.rms_norm_eps)
        cos, sin = rope.cos_sin(spec, ctx.state.positions.long())  # [M, hd/2] each
        y = rope.apply_rope(y[:, None, :], cos, sin)[:, 0, :]
    return y


def finish(ctx: OpContext, ins: AttnIn) -> None:
    kind, idx, _, _, _ = _head(ctx, ins)
    y = finish_rows(ctx, ins.layer, ins.head, ins.n_parts)
    if kind == "q":
        ctx.scratch.q[:, idx, :] = y
        return
    pages, slots = kv_slots(ctx, ctx.state.positions.long())
    pool = ctx.cache.k if kind == "k" else ctx.cache.v
    pool[ins.layer, pages, idx, slots] = y.to(pool.dtype)


def kv_slots(ctx: OpContext, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, rows in page) [M] of each step token's KV slot, through its segment's block table."""
    shape, ps = ctx.program.shape, ctx.cache.layout.page_size
    seg_of = torch.repeat_interleave(torch.arange(len(shape.seg_lens)), torch.tensor(shape.seg_lens))  # [M]
    tables = ctx.state.block_tables.long()  # [S, P]
    return tables[seg_of, positions // ps], positions % ps
