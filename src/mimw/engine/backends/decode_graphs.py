"""DecodeGraphs: a step of B single-token segments through the prefill path's layers, as one CUDA graph per B.

Eager, the prefill path's pass launches ~10 kernels a layer from Python, so a decode batch costs milliseconds of
launches whatever B (the 1B shape: ~5 ms on an H100 for 0.8-1.5 ms of HBM traffic). Captured once per batch size,
the same pass replays with no launch gaps. What changes between steps is data, copied into the graph's static
inputs before each replay: the tokens, each row's position and cache slot, each segment's start and context, and
its block table (zero-padded to the graphs' common width; entries past a segment's context are never read). The
attention kernel's grid (query heads x B) and work list (every segment's one query row) do not depend on the
contexts, so one graph serves any contexts; a block table wider than the graphs' width recaptures them wider.

Capture: one eager pass on the step's real inputs first (compilation, autotuning; it writes the same K/V rows the
replay rewrites), then the capture, then the replay. Every graph draws on one memory pool (graphs replay one at a
time, and each step's logits are copied out before the next replay). Invariants are ``Backend.forward``'s.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.reference import Segment
from ...prefill import PrefillRunner
from ...prefill.batch import Piece, PrefillBatch

_STEP_FIELDS = ("positions", "slots", "q_start", "seq_start", "seq_ctx", "logit_rows")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B] int64, static input
    batch: PrefillBatch  # static inputs (device tensors) the captured kernels read
    logits: torch.Tensor  # [B, V] fp32, static output


class DecodeGraphs:
    def __init__(self, runner: PrefillRunner, cache: PagedKVCache):
        self.runner = runner
        self.cache = cache
        self.width = 0  # block-table columns every graph's static batch holds
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """tokens [B] (one a segment) -> fp32 logits [B, vocab]; writes each token's K/V into the cache."""
        if any(s.length != 1 or s.num_logits != 1 for s in segments):
            raise ValueError("DecodeGraphs runs segments of one token with one logit row each")
        pieces = [Piece(tuple(s.block_table), s.start, 1, 1) for s in segments]
        host = PrefillBatch.build(pieces, self.cache.layout.page_size, "cpu")
        if host.block_tables.shape[1] > self.width:
            self.width = max(host.block_tables.shape[1], 2 * self.width)
            self.graphs.clear()  # their static block tables are too narrow
        g = self.graphs.get(len(pieces))
        if g is None:
            g = self._capture(tokens, host)
            self.graphs[len(pieces)] = g
        else:
            self._load(g, tokens, host)
        g.graph.replay()
        return g.logits.clone()

    def _load(self, g: _Graph, tokens: torch.Tensor, host: PrefillBatch) -> None:
        g.tokens.copy_(tokens)
        for name in _STEP_FIELDS:
            getattr(g.batch, name).copy_(getattr(host, name))
        g.batch.block_tables.zero_()
        g.batch.block_tables[:, :host.block_tables.shape[1]].copy_(host.block_tables)

    def _capture(self, tokens: torch.Tensor, host: PrefillBatch) -> _Graph:
        dev = self.runner.w.device
        tables = torch.zeros(host.block_tables.shape[0], self.width, dtype=host.block_tables.dtype)
        tables[:, :host.block_tables.shape[1]] = host.block_tables
        values = {f.name: getattr(host, f.name) for f in fields(PrefillBatch) if f.name not in ("_work",)}
        values["block_tables"] = tables
        batch = PrefillBatch(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in values.items()})
        static_tokens = tokens.to(device=dev, dtype=torch.long).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            self.runner._pass(static_tokens, batch, self.cache)  # compile and autotune outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            logits = self.runner._pass(static_tokens, batch, self.cache)
        return _Graph(graph, static_tokens, batch, logits)
