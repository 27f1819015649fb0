"""FlexAttention over gathered pages, one call for all pieces of a pass, with a block mask built from the pieces'
geometry (never by evaluating the mask over [T, S]).

Every piece's K/V (positions 0..ctx-1) is gathered into one packed key sequence (piece b's keys at kv_off[b] + p);
the queries are the pass's rows. Row r of piece b at position pos sees packed keys kv_off[b] .. kv_off[b] + pos.
Along the rows that upper bound only grows, so a block of ``BLOCK`` query rows touches the key blocks from its first
row's kv_off to its last row's bound. A key block is *full* (no mask evaluated) when it lies inside one piece's
prefix that the block's first row already sees; the others are *partial* and evaluate ``mask_mod`` (same piece,
key position <= query position).

The cache layout (pages of [Hkv, PS, hd]) has no zero-copy [1, Hkv, S, hd] view, which FlexAttention's paged mode
would need, hence the gather (which dequantises an fp8 cache's rows, ``gathered_attention.gather``, then rounds
them to q's dtype). The kernel is compiled once by ``torch.compile`` with dynamic shapes.
"""
from __future__ import annotations

import torch

from .batch import PrefillBatch
from .gathered_attention import gather

BLOCK = 128  # FlexAttention's default sparse block, both ways


def block_tables_for(batch: PrefillBatch, block: int = BLOCK):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) [1, 1, QB(, KB)] int32, on the host."""
    starts = [p.start for p in batch.pieces]
    lengths = [p.length for p in batch.pieces]
    kv_off, q_off, acc_k, acc_q = [], [], 0, 0
    for s, n in zip(starts, lengths):
        kv_off.append(acc_k)
        q_off.append(acc_q)
        acc_k += s + n
        acc_q += n
    t, s_tot = acc_q, acc_k
    qb, kb = -(-t // block), -(-s_tot // block)
    piece_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    part_n = torch.zeros(qb, dtype=torch.int32)
    part_i = torch.zeros(qb, kb, dtype=torch.int32)
    full_n = torch.zeros(qb, dtype=torch.int32)
    full_i = torch.zeros(qb, kb, dtype=torch.int32)
    for i in range(qb):
        r_first, r_last = i * block, min(t, (i + 1) * block) - 1
        b0, b1 = int(piece_of[r_first]), int(piece_of[r_last])
        pos_first = starts[b0] + r_first - q_off[b0]
        lo = kv_off[b0]
        hi = kv_off[b1] + starts[b1] + r_last - q_off[b1]  # last key the last row sees
        full_lo, full_hi = 0, -1
        if b0 == b1:  # blocks inside [lo, lo + pos_first] are seen by every row
            full_lo, full_hi = -(-lo // block), (lo + pos_first + 1) // block - 1
        full = list(range(full_lo, full_hi + 1))
        part = [j for j in range(lo // block, hi // block + 1) if not full_lo <= j <= full_hi]
        full_n[i], part_n[i] = len(full), len(part)
        full_i[i, :len(full)] = torch.tensor(full, dtype=torch.int32)
        part_i[i, :len(part)] = torch.tensor(part, dtype=torch.int32)
    return part_n[None, None], part_i[None, None], full_n[None, None], full_i[None, None]


class FlexPagedAttention:
    """``flex_attention`` over the pass's gathered K/V; ``compile=False`` runs it eagerly (CPU tests)."""

    def __init__(self, compile: bool = True):
        from torch.nn.attention.flex_attention import flex_attention

        self._flex = torch.compile(flex_attention, dynamic=True) if compile else flex_attention

    def block_mask(self, batch: PrefillBatch):
        from torch.nn.attention.flex_attention import BlockMask

        dev = batch.device
        seg_q = torch.repeat_interleave(torch.arange(len(batch.pieces), device=dev),
                                        torch.tensor([p.length for p in batch.pieces], device=dev))
        ctxs = torch.tensor([p.ctx for p in batch.pieces], device=dev)
        seg_k = torch.repeat_interleave(torch.arange(len(batch.pieces), device=dev), ctxs)
        pos_k = torch.cat([torch.arange(c, device=dev) for c in ctxs.tolist()])
        pos_q = batch.positions

        def mask_mod(b, h, q_idx, kv_idx):
            return (seg_q[q_idx] == seg_k[kv_idx]) & (pos_k[kv_idx] <= pos_q[q_idx])

        tables = [x.to(dev) for x in block_tables_for(batch)]
        return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                        seq_lengths=(batch.num_tokens, int(ctxs.sum())))

    def plan(self, batch: PrefillBatch):
        """The attention of one pass: its block mask is built here, once for every layer."""
        mask = self.block_mask(batch)
        n = len(batch.pieces)

        def run(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
            k = torch.cat([gather(k_layer, batch, b, k_scale) for b in range(n)], dim=1)[None].to(q.dtype)
            v = torch.cat([gather(v_layer, batch, b, v_scale) for b in range(n)], dim=1)[None].to(q.dtype)
            out = self._flex(q.transpose(0, 1)[None].contiguous(), k, v, block_mask=mask, enable_gqa=True)
            return out[0].transpose(0, 1)

        return run
