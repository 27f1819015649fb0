"""StepGraphs: short multi-token steps (decode batches, verify blocks) through the prefill path's layers, replayed
as one CUDA graph per step pattern.

Eager, the prefill path's pass launches ~10 kernels a layer from Python, so a short step costs milliseconds of
launches whatever its size (the 1B shape: ~5 ms on an H100 for 0.8-1.5 ms of HBM traffic). Captured once, the same
pass replays with no launch gaps. A step qualifies when each of its segments fits one query block of the paged
attention kernel (``length <= block_m``): the kernel's grid (query heads x segments) and work list (one block per
segment) then do not depend on the contexts, so one graph serves any contexts. Its pattern, the segments' (length,
logit rows) in order, names its graph. A pattern is captured the second time it is seen: the first runs eager, so a
one-off pattern (a prefill chunk's mix of lengths) never pays a capture, which costs ~10 ms and drains the GPU's
queue (``torch.cuda.graph`` synchronises the device and empties the allocator's cache before it records), while a
decode batch or verify layout that repeats is captured on its second step. What changes between steps is data, copied into the graph's static inputs
before each replay (from pinned host memory, without waiting for the GPU: ``pinned.copy_in``): the tokens, each
row's position and cache slot, each segment's start and context, and its block table (zero-padded to the graphs'
common width; entries past a segment's context are never read). That width starts at ``MIN_TABLE_TOKENS`` of
context (at most the pool's pages), so short and mid-length contexts never recapture; a block table wider than it
doubles it and recaptures the graphs wider.

Capture: one eager pass on the step's real inputs first (compilation, autotuning; it writes the same K/V rows the
replay rewrites), then the capture, then the replay. Every graph draws on one memory pool (graphs replay one at a
time, and each step's logits are copied out before the next replay; a recapture wider starts a new pool). At most
``max_graphs`` patterns are kept (least recently used dropped). Invariants are ``Backend.forward``'s.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...pinned import copy_in
from ...models.reference import Segment
from ...prefill import PrefillRunner
from ...prefill.batch import Piece, PrefillBatch
from ...prefill.paged_attention import AttentionTiles

_STEP_FIELDS = ("positions", "slots", "q_start", "seq_start", "seq_ctx", "logit_rows")
MIN_TABLE_TOKENS = 8192  # context the graphs' block tables hold from the start (a 32-row table: 64 KB at page 16)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [T] int64, static input
    batch: PrefillBatch  # static inputs (device tensors) the captured kernels read
    logits: torch.Tensor  # [sum(num_logits), V] fp32, static output


def block_m(runner: PrefillRunner) -> int | None:
    """Query rows of one block of the runner's paged attention kernel; None when its attention is another (whose
    shapes follow the contexts: no graph)."""
    if runner.config.attention != "triton":
        return None
    return (runner.config.tiles or AttentionTiles.for_head_dim(runner.spec.head_dim)).block_m


class StepGraphs:
    def __init__(self, runner: PrefillRunner, cache: PagedKVCache, max_graphs: int = 64):
        self.runner = runner
        self.cache = cache
        self.block_m = block_m(runner)
        self.max_graphs = max_graphs
        layout = cache.layout
        # block-table columns every graph's static batch holds
        self.width = min(layout.num_pages, -(-MIN_TABLE_TOKENS // layout.page_size))
        self.captures = 0  # graphs captured so far
        self.eager = 0  # steps run eager: a pattern's first sighting
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # patterns seen once, not captured (at most 4 x max_graphs)
        self.pool = torch.cuda.graph_pool_handle()

    @property
    def unmeasured(self) -> int:
        """Steps so far that were no measure of a replay: captures and first sightings (eager)."""
        return self.captures + self.eager

    def fits(self, segments: Sequence[Segment]) -> bool:
        return self.block_m is not None and all(s.length <= self.block_m for s in segments)

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """tokens [T] (the segments' tokens concatenated) -> fp32 logits [sum(num_logits), vocab]; writes each
        token's K/V into the cache."""
        if not self.fits(segments):
            raise ValueError(f"StepGraphs runs segments of at most {self.block_m} tokens on the paged kernel")
        pieces = [Piece(tuple(s.block_table), s.start, s.length, s.num_logits) for s in segments]
        host = PrefillBatch.build(pieces, self.cache.layout.page_size, "cpu")
        if host.block_tables.shape[1] > self.width:
            self.width = max(host.block_tables.shape[1], 2 * self.width)
            self.seen.update(dict.fromkeys(self.graphs))  # known to repeat: recaptured at their next step
            self.graphs.clear()  # their static block tables are too narrow
            # with its last graph gone the caching allocator frees the private pool, and a capture into a freed
            # pool's handle fails: the wider graphs draw on a new one
            self.pool = torch.cuda.graph_pool_handle()
        key = tuple((p.length, p.num_logits) for p in pieces)
        g = self.graphs.get(key)
        if g is None and key not in self.seen:  # a first sighting: eager, remembered
            self.seen[key] = None
            if len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
            self.eager += 1
            return self.runner.forward(tokens, segments, self.cache)
        if g is None:
            self.seen.pop(key)
            g = self._capture(tokens, host)
            self.graphs[key] = g
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            self._load(g, tokens, host)
        g.graph.replay()
        return g.logits.clone()

    def _load(self, g: _Graph, tokens: torch.Tensor, host: PrefillBatch) -> None:
        """The step's inputs into the graph's static tensors, queued before the replay without waiting for the
        GPU (``pinned.copy_in``), so the host can prepare the next step while this one runs."""
        copy_in(g.tokens, tokens)
        for name in _STEP_FIELDS:
            copy_in(getattr(g.batch, name), getattr(host, name))
        g.batch.block_tables.zero_()
        copy_in(g.batch.block_tables[:, :host.block_tables.shape[1]], host.block_tables)

    def _capture(self, tokens: torch.Tensor, host: PrefillBatch) -> _Graph:
        dev = self.runner.w.device
        tables = torch.zeros(host.block_tables.shape[0], self.width, dtype=host.block_tables.dtype)
        tables[:, :host.block_tables.shape[1]] = host.block_tables
        values = {f.name: getattr(host, f.name) for f in fields(PrefillBatch) if f.name != "_work"}
        values["block_tables"] = tables
        batch = PrefillBatch(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in values.items()})
        static_tokens = tokens.to(device=dev, dtype=torch.long).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            self.runner._pass(static_tokens, batch, self.cache)  # compile, autotune, build the work list
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            logits = self.runner._pass(static_tokens, batch, self.cache)
        self.captures += 1
        return _Graph(graph, static_tokens, batch, logits)
