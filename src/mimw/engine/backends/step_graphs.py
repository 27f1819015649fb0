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
decode batch or verify layout that repeats is captured on its second step. What changes between steps is data,
written into the graph's static inputs before each replay: the tokens, each row's position and cache slot, each
segment's start and context, its logit rows and its block table (in the graphs' common width, written as far as
the step's widest table: entries past a segment's context are never read, so older ones may stay). The static
inputs of a graph are views into one buffer (``StepInputs``), packed on the host with numpy and written by one
non-blocking copy from pinned memory a step, as far as the step's table rows (then spread into the [B, width]
tables on the device; tokens already on the device, the previous step's samples, by one more copy there), so
queueing a step never waits for the GPU and copies what the step uses, not the common width.
The common width starts at ``MIN_TABLE_TOKENS`` of context (at most the pool's pages), so short and mid-length
contexts never recapture; a block table wider than it doubles it and recaptures the graphs wider.

Decode batches pad to buckets: with ``pad_page`` (a page of the cache no sequence owns: the megakernel backend's),
a step of B one-token segments runs as the power of two at or above B (``padded``), the extra segments one token
at position 0 of that page (they write and read only its first row; their logits are computed and not returned).
So every B of a bucket is one pattern, one graph: the batch shrinking as requests finish meets patterns captured
before, where each new B would run eager (~3-10 ms of launches) and then capture; the pass costs about the same at
B and at its bucket (its weights are read once either way).

Capture: one eager pass on the step's real inputs first (compilation, autotuning; it writes the same K/V rows the
replay rewrites), then the capture, then the replay. Every graph draws on one memory pool (graphs replay one at a
time, and each step's logits are copied out before the next replay; a recapture wider starts a new pool). Which
patterns replay, capture or run eager, and the LRU bounds, are ``GraphPatterns``'s (graph_patterns.py). Invariants
are ``Backend.forward``'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ...kv.pages import PagedKVCache
from ...models.reference import Segment
from ...prefill import PrefillRunner
from ...prefill.batch import Piece, PrefillBatch
from ...prefill.gluon_attention import GROUPED_ROWS
from ...prefill.paged_attention import AttentionTiles
from ...step_inputs import Field, StepInputs
from ..step_costs import bucket
from .graph_patterns import CAPTURE, EAGER, GraphPatterns

MIN_TABLE_TOKENS = 8192  # context the graphs' block tables hold from the start (a 32-row table: 64 KB at page 16)


def input_fields(tokens: int, segments: int, logit_rows: int, width: int) -> tuple[Field, ...]:
    """A graph's static inputs: the tokens [T] and ``PrefillBatch``'s tensors (its dtypes), the block tables as
    ``table_rows`` (the step's rows packed at its own width, copied only as far as the step uses them) and, on the
    device only, ``block_tables`` [B, width] (what the kernels read, at the graphs' common width, written from
    table_rows on the device)."""
    t, b = tokens, segments
    return (Field("tokens", torch.int64, (t,)), Field("positions", torch.int64, (t,)),
            Field("slots", torch.int64, (t,)), Field("logit_rows", torch.int64, (logit_rows,)),
            Field("q_start", torch.int32, (b,)), Field("seq_start", torch.int32, (b,)),
            Field("seq_ctx", torch.int32, (b,)), Field("table_rows", torch.int32, (b * width,)),
            Field("block_tables", torch.int32, (b, width), host=False))


def padded(segments: Sequence[Segment], pad_page: int | None) -> list[Segment]:
    """``segments``, and where they are a decode batch (every segment one token with its logits) and ``pad_page`` is
    given, one-token segments at position 0 of ``pad_page`` up to the power of two at or above their count."""
    out = list(segments)
    if pad_page is not None and all(s.length == 1 and s.num_logits == 1 for s in out):
        out += [Segment((pad_page,), 0, 1, 1)] * (bucket(len(out)) - len(out))
    return out


def load(inputs: StepInputs, tokens: torch.Tensor, host: dict[str, np.ndarray]) -> None:
    """One step into a graph's inputs: ``host`` (``PrefillBatch.arrays``: block tables at the step's widest) and
    the tokens packed into the next pinned buffer and copied at once, as far as the step's table rows; the rows
    spread into the kernels' [B, width] tables on the device (the columns past the step's width keep older entries:
    every read is of a page below its segment's context, so none is read); tokens on the device copied there, after
    that copy (which rewrites the tokens field too). Fewer tokens than the field holds (a padded step) fill its
    start; the padding's ids are 0."""
    tables = host["block_tables"]
    b, w = tables.shape
    staged = inputs.stage(inputs.end("table_rows", b * w))
    for name, a in host.items():
        if name == "block_tables":
            staged.array("table_rows", b * w)[:] = a.reshape(-1)
        else:
            staged.array(name)[:] = a
    on_host = tokens.device.type == "cpu"
    n = tokens.numel()
    ids = staged.array("tokens")
    ids[n:] = 0
    if on_host:
        ids[:n] = tokens.numpy()
    inputs.load(staged)
    inputs.spread("table_rows", "block_tables", b, w)
    if not on_host:
        inputs["tokens"][:n].copy_(tokens)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: StepInputs  # the static inputs: tokens [T] int64 and the batch's tensors, views into one buffer
    batch: PrefillBatch  # the static inputs (views of ``inputs``) the captured kernels read
    logits: torch.Tensor  # [sum(num_logits), V] fp32, static output


def block_m(runner: PrefillRunner) -> int | None:
    """Query rows of one block of the runner's paged attention kernel: the Triton kernel's, or where the runner's
    attention is the Gluon kernel's the most rows of the passes it hands to the Triton kernel's grouped path (a
    graph replays the Triton kernel only: its launch grid is the step's pattern's); None when its attention is
    another (whose shapes follow the contexts: no graph)."""
    if runner.config.attention == "gluon":
        return GROUPED_ROWS
    if runner.config.attention != "triton":
        return None
    return (runner.config.tiles or AttentionTiles.for_head_dim(runner.spec.head_dim)).block_m


class StepGraphs:
    def __init__(self, runner: PrefillRunner, cache: PagedKVCache, max_graphs: int = 64, pad_page: int | None = None):
        self.runner = runner
        self.cache = cache
        self.pad_page = pad_page  # a page of ``cache`` no sequence owns: decode batches pad to buckets on it
        self.block_m = block_m(runner)
        layout = cache.layout
        # which patterns replay, capture or run eager, and the block-table width of every graph
        self.patterns: GraphPatterns[_Graph] = GraphPatterns(
            min(layout.num_pages, -(-MIN_TABLE_TOKENS // layout.page_size)), max_graphs)
        self.pool = torch.cuda.graph_pool_handle()

    def fits(self, segments: Sequence[Segment]) -> bool:
        return self.block_m is not None and all(s.length <= self.block_m for s in segments)

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """tokens [T] (the segments' tokens concatenated) -> fp32 logits [sum(num_logits), vocab]; writes each
        token's K/V into the cache (and a padded decode batch's padding rows into ``pad_page``)."""
        if not self.fits(segments):
            raise ValueError(f"StepGraphs runs segments of at most {self.block_m} tokens on the paged kernel")
        rows, real = sum(s.num_logits for s in segments), len(segments)
        segments = padded(segments, self.pad_page)
        pieces = [Piece(tuple(s.block_table), s.start, s.length, s.num_logits) for s in segments]
        host = PrefillBatch.arrays(pieces, self.cache.layout.page_size)
        if self.patterns.widen(host["block_tables"].shape[1]):  # every graph dropped: their tables were too narrow
            # with its last graph gone the caching allocator frees the private pool, and a capture into a freed
            # pool's handle fails: the wider graphs draw on a new one
            self.pool = torch.cuda.graph_pool_handle()
        key = tuple((p.length, p.num_logits) for p in pieces)
        what = self.patterns.decide(key)
        if what == EAGER:
            pad = len(pieces) - real  # padding segments are one token each
            ids = torch.cat([tokens.reshape(-1), tokens.new_zeros(pad)]) if pad else tokens
            return self.runner.forward(ids, segments, self.cache)[:rows]
        if what == CAPTURE:
            g = self._capture(tokens, pieces, host)
            self.patterns.store(key, g)
        else:
            g = self.patterns.graphs[key]
            load(g.inputs, tokens, host)
        g.graph.replay()
        return g.logits[:rows].clone()

    def _capture(self, tokens: torch.Tensor, pieces: list[Piece], host: dict[str, np.ndarray]) -> _Graph:
        t, b, r = host["positions"].shape[0], len(pieces), host["logit_rows"].shape[0]
        inputs = StepInputs(input_fields(t, b, r, self.patterns.width), self.runner.w.device)
        load(inputs, tokens, host)
        batch = PrefillBatch(tuple(pieces), self.cache.layout.page_size, **{k: inputs[k] for k in host})
        static_tokens = inputs["tokens"]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            self.runner._pass(static_tokens, batch, self.cache)  # compile, autotune, build the work list
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            logits = self.runner._pass(static_tokens, batch, self.cache)
        return _Graph(graph, inputs, batch, logits)
