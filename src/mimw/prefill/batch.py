"""PrefillBatch: what one prefill pass knows about its segments, built once on the host and copied to the device
together; every layer's kernels read it.

A pass is a list of ``Piece``s (a ``Segment``, or part of one when a call is split into passes): ``length`` new
tokens of one sequence at positions start .. start+length-1. The pass's rows are the pieces' tokens concatenated;
piece b owns rows q_start[b] .. q_start[b]+length-1, and its keys are positions 0 .. ctx-1 (ctx = start+length)
of its sequence, read through its block table (``mimw.kv.pages``: position p at page block_table[p // page_size],
row p % page_size).

Device tensors (int32 unless noted):
  positions [T] int64     position of every row
  slots [T] int64         page * page_size + row where every row's K/V is written
  q_start, seq_start, seq_ctx [B]
  block_tables [B, max_pages]   padded with page 0 (never read: positions >= ctx are masked)
  logit_rows [R] int64    rows that get logits: each piece's last ``num_logits`` tokens, in piece order
``work(block_m)`` lists the attention kernel's query blocks, longest key range first. On a GPU the host tensors go
through pinned memory by non-blocking copies (``pinned.to_device``): a pass never waits for the kernels queued
before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..pinned import to_device


@dataclass(frozen=True)
class Piece:
    """``length`` tokens of one sequence from position ``start``; its last ``num_logits`` (0 or more) get logits."""

    block_table: tuple[int, ...]
    start: int
    length: int
    num_logits: int = 1

    @property
    def ctx(self) -> int:
        return self.start + self.length


def split_passes(pieces: Sequence[Piece], max_tokens: int) -> list[list[Piece]]:
    """Cut a call's pieces (in order) into passes of at most ``max_tokens`` tokens. A piece cut in two keeps its
    logit rows where its last tokens land; the later part reads the earlier one's K/V from the cache, so running the
    passes in order computes exactly what one pass would."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    passes: list[list[Piece]] = [[]]
    room = max_tokens
    for p in pieces:
        done = 0
        while done < p.length:
            if room == 0:
                passes.append([])
                room = max_tokens
            n = min(room, p.length - done)
            logits_here = max(0, min(n, p.num_logits - (p.length - done - n)))
            passes[-1].append(Piece(p.block_table, p.start + done, n, logits_here))
            done += n
            room -= n
    return [ps for ps in passes if ps]


@dataclass
class PrefillBatch:
    pieces: tuple[Piece, ...]
    page_size: int
    positions: torch.Tensor
    slots: torch.Tensor
    q_start: torch.Tensor
    seq_start: torch.Tensor
    seq_ctx: torch.Tensor
    block_tables: torch.Tensor
    logit_rows: torch.Tensor
    _work: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @classmethod
    def build(cls, pieces: Sequence[Piece], page_size: int, device: torch.device | str) -> "PrefillBatch":
        """The pass's tensors (``arrays``) on ``device``."""
        host = cls.arrays(pieces, page_size)
        return cls(tuple(pieces), page_size, **{k: to_device(torch.from_numpy(v), device) for k, v in host.items()})

    @staticmethod
    def arrays(pieces: Sequence[Piece], page_size: int) -> dict[str, np.ndarray]:
        """The pass's tensors as host arrays, by field name (the dtypes of the module doc; block_tables at the
        pieces' widest table), computed for all pieces at once (numpy over the rows, one Python step a piece for
        its checks and its block-table row): a decode step of 32 one-token pieces builds in a fraction of its GPU
        time, so the host keeps ahead of the graphed pass."""
        if not pieces:
            raise ValueError("a prefill pass needs at least one piece")
        n = len(pieces)
        starts = np.fromiter((p.start for p in pieces), np.int64, n)
        lengths = np.fromiter((p.length for p in pieces), np.int64, n)
        n_logits = np.fromiter((p.num_logits for p in pieces), np.int64, n)
        need = -(-(starts + lengths) // page_size)
        width = int(need.max()) if (lengths > 0).all() else 0
        bts = np.zeros((n, width), np.int32)
        for i, p in enumerate(pieces):
            if p.length <= 0 or p.start < 0 or not 0 <= p.num_logits <= p.length:
                raise ValueError(f"bad piece: start {p.start}, length {p.length}, num_logits {p.num_logits}")
            k = int(need[i])
            if k > len(p.block_table):
                raise IndexError(f"position {p.ctx - 1} needs {k} pages, block table has {len(p.block_table)}")
            bts[i, :k] = p.block_table[:k]
        ends = np.cumsum(lengths)
        q_start = ends - lengths
        owner = np.repeat(np.arange(n), lengths)  # the piece of every row
        positions = np.arange(int(ends[-1])) - q_start[owner] + starts[owner]
        slots = bts[owner, positions // page_size].astype(np.int64) * page_size + positions % page_size
        # each piece's last num_logits rows, in piece order
        first = np.repeat(ends - n_logits, n_logits)
        logit_rows = first + np.arange(int(n_logits.sum())) - np.repeat(np.cumsum(n_logits) - n_logits, n_logits)
        return {"positions": positions, "slots": slots, "q_start": q_start.astype(np.int32),
                "seq_start": starts.astype(np.int32), "seq_ctx": (starts + lengths).astype(np.int32),
                "block_tables": bts, "logit_rows": logit_rows}

    def work(self, block_m: int) -> torch.Tensor:
        """[NW, 2] int32 (piece, first row within the piece) of every block of ``block_m`` query rows, the blocks
        that see the most keys first (so the longest programs start first and the tail of the grid is short)."""
        if block_m not in self._work:
            items, cost = [], []
            for b, p in enumerate(self.pieces):
                for m0 in range(0, p.length, block_m):
                    items.append((b, m0))
                    cost.append(p.start + min(p.length, m0 + block_m))
            order = sorted(range(len(items)), key=lambda i: -cost[i])
            w = torch.tensor([items[i] for i in order], dtype=torch.int32)
            self._work[block_m] = to_device(w, self.device)
        return self._work[block_m]
