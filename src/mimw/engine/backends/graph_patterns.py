"""GraphPatterns: which short steps replay a CUDA graph, which capture one and which run eager (pure Python; the
bookkeeping of ``StepGraphs``).

A step's pattern (its segments' lengths and logit rows, in order) names a graph. A capture costs ~10 ms and drains
the GPU's queue (``torch.cuda.graph`` synchronises the device and empties the allocator's cache before it records),
so a pattern is captured only once it has shown it repeats: its first sighting runs eager and is remembered, its
second captures, later ones replay. Every graph's static block table is ``width`` columns wide; a step
whose table is wider widens it (at least doubling) and drops every graph (their tables are too narrow), remembering
their patterns as seen, so each recaptures at its next step. At most ``max_graphs`` graphs and ``4 * max_graphs``
seen patterns are kept, least recently used dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

G = TypeVar("G")
EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"


class GraphPatterns(Generic[G]):
    def __init__(self, width: int, max_graphs: int = 64):
        if width < 1 or max_graphs < 1:
            raise ValueError(f"width {width} and max_graphs {max_graphs} must be positive")
        self.width = width  # block-table columns of every graph's static inputs
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, G] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # patterns seen, not (or no longer) captured
        self.captures = 0  # CAPTURE decisions so far
        self.eager = 0  # EAGER decisions so far

    @property
    def unmeasured(self) -> int:
        """Steps so far that were no measure of a replay: captures and first sightings."""
        return self.captures + self.eager

    def widen(self, table_width: int) -> bool:
        """Make the graphs' tables hold ``table_width`` columns; True when that dropped every graph (the caller's
        memory pool for them can start anew)."""
        if table_width <= self.width:
            return False
        self.width = max(table_width, 2 * self.width)
        self._remember(*self.graphs)
        self.graphs.clear()
        return True

    def decide(self, key: tuple) -> str:
        """REPLAY (``graphs[key]``), CAPTURE (then ``store``) or EAGER for a step of pattern ``key``."""
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return REPLAY
        if key in self.seen:
            del self.seen[key]
            self.captures += 1
            return CAPTURE
        self._remember(key)
        self.eager += 1
        return EAGER

    def store(self, key: tuple, graph: G) -> None:
        """The graph a CAPTURE decision made."""
        self.graphs[key] = graph
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)

    def _remember(self, *keys: tuple) -> None:
        for k in keys:
            self.seen[k] = None
            self.seen.move_to_end(k)
        while len(self.seen) > 4 * self.max_graphs:
            self.seen.popitem(last=False)
