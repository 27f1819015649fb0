"""Tensor-parallel launches: N ranks' decoders, the peer memory their kernels send to, and the address tables that
link them (device/peer.py; docs/megakernel.md, "Tensor parallelism").

``link`` hands every rank the addresses of all ranks' inbox buffers (peers.py's layout) and counter tables. ``SharedGPUGroup`` runs N ranks on one GPU, each rank's persistent kernel on its own share of
the SMs and its own stream, launched together: every cross-rank path of the kernel (stores into another rank's
inbox, adds to another rank's counters, system-scope waits) runs as it would across GPUs, only over one GPU's
memory. Its ranks' kernels must all be resident at once (each rank waits for the others inside its launch), which
``num_sms // N`` CTAs a rank of one CTA an SM are; a step that does not finish within ``timeout_s`` raises.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.weights import ModelWeights
from ..peers import alloc_peer_memory, inbox_elements
from ..plan import Constants, Tuning
from ..tensor_parallel import TensorParallel, shard_cache
from .decoder import MegakernelDecoder


def inbox_shape(c: Constants) -> tuple[int, int, int, int]:
    """(ranks, tokens, hidden, the shard's vocabulary) of a rank's inboxes (peers.alloc_peer_memory's arguments)."""
    return c.TP, c.M, c.D, c.V


def link(decoders: Sequence[MegakernelDecoder], boxes: Sequence[torch.Tensor]) -> None:
    """Give every rank's decoder (rank order) the address tables of all ranks' inbox buffers ``boxes`` and counter
    tables (their step states' counters); each table on the decoder's own device."""
    if [d.tp for d in decoders] != [(r, len(decoders)) for r in range(len(decoders))]:
        raise ValueError(f"decoders of ranks {[d.tp for d in decoders]}: need ranks 0 .. {len(decoders) - 1} of "
                         f"{len(decoders)} in order")
    need = inbox_elements(*inbox_shape(decoders[0].plan.constants))
    if any(b.dtype != torch.float32 or b.numel() < need for b in boxes):
        raise ValueError(f"each rank's inbox buffer needs {need} fp32 elements")
    addr = lambda ts, dev: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)  # noqa: E731
    for d in decoders:
        d.link(addr(boxes, d.cache.device), addr([x.state.counters for x in decoders], d.cache.device))


class SharedGPUGroup:
    """N ranks of ``weights`` (the whole model) on one GPU, ``num_sms`` (default: the GPU's) shared out evenly;
    ``cache`` holds every KV head (each rank gets a copy of its heads: ``gather`` writes the ranks' rows back).
    ``step`` and ``step_batch`` run every rank's kernel once and return rank 0's logits; ``disagreements`` counts
    the steps whose ranks' logits were not bit-identical (every rank gathers the same partials in rank order)."""

    def __init__(self, weights: ModelWeights, cache: PagedKVCache, size: int, max_pages_per_seq: int | None = None,
                 tuning: Tuning = Tuning(), num_sms: int | None = None, context_hint: int = 1024, batch: int = 1,
                 timeout_s: float = 30.0):
        dev = cache.device
        total = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
        if total // size < 1:
            raise ValueError(f"{total} SMs do not hold {size} ranks")
        tile_rows = tuning.resolve(weights.spec).tile_rows
        self.ranks = [TensorParallel(weights.spec, r, size, tile_rows) for r in range(size)]
        self.cache, self.timeout_s = cache, timeout_s
        self.decoders = [MegakernelDecoder(weights, shard_cache(cache, tp), max_pages_per_seq, tuning, total // size,
                                           context_hint, batch=batch, tp=(tp.rank, size)) for tp in self.ranks]
        self.memory = alloc_peer_memory(*inbox_shape(self.decoders[0].plan.constants), device=dev)
        link(self.decoders, self.memory.buffers)
        self.streams = [torch.cuda.Stream(dev) for _ in self.decoders]
        self.disagreements = 0

    def poison(self) -> None:
        """NaN in every rank's scratch and inboxes (nothing may read what this step did not write)."""
        for d in self.decoders:
            d.scratch.poison()
        self.memory.poison()

    def step(self, token: int, position: int, block_table: Sequence[int]) -> torch.Tensor:
        return self.step_batch([token], [position], [block_table])

    def step_batch(self, tokens: Sequence[int], positions: Sequence[int],
                   block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One launch of every rank (each its stream, all in flight together) -> rank 0's logits [B, V]."""
        for d in self.decoders:
            d.set_batch(tokens, positions, block_tables)
        ready = torch.cuda.current_stream().record_event()
        for d, s in zip(self.decoders, self.streams):
            s.wait_event(ready)
            with torch.cuda.stream(s):
                d.launch()
        done = [s.record_event() for s in self.streams]
        start = time.monotonic()
        while not all(e.query() for e in done):
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(f"the {len(self.decoders)} ranks' kernels did not finish in {self.timeout_s} s: "
                                   "not all resident at once, or a peer wait never met")
            time.sleep(1e-4)
        for e in done:
            torch.cuda.current_stream().wait_event(e)
        logits = [d.scratch.logits for d in self.decoders]
        self.disagreements += int(not all(torch.equal(logits[0], x) for x in logits[1:]))
        return logits[0]

    def gather(self, cache: PagedKVCache | None = None) -> None:
        """Copy every rank's KV heads back into ``cache`` (default: the one the group was built from)."""
        cache = cache or self.cache
        for tp, d in zip(self.ranks, self.decoders):
            h = tp.kv_heads
            cache.k[:, :, h] = d.cache.k
            cache.v[:, :, h] = d.cache.v
            if cache.k_scale is not None:
                cache.k_scale[:, :, h] = d.cache.k_scale
                cache.v_scale[:, :, h] = d.cache.v_scale


__all__ = ["inbox_shape", "link", "SharedGPUGroup"]
