"""Tensor-parallel launches: N ranks' decoders, the peer memory their kernels send to, and the address tables that link
them (device/peer.py; docs/megakernel.md, "Tensor parallelism").

``link`` hands every rank the addresses of all ranks' inbox buffers (peers.py's layout) and counter tables.
``DistributedRank`` is one rank of N across GPUs, one process a GPU (torchrun; NCCL sets the group up): its inbox
buffer and counter table in symmetric memory (``torch.distributed._symmetric_memory``), whose peers' addresses fill
the same tables; every rank steps in lockstep with the same inputs. NVLink multicast stays off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the first allocation; stores and adds are point to point).
``SharedGPUGroup`` runs N ranks on one GPU, each rank's persistent kernel on its own share of the SMs and its own
stream, launched together: every cross-rank path of the kernel (stores into another rank's inbox, adds to another
rank's counters, system-scope waits) runs as it would across GPUs, only over one GPU's memory. Its ranks' kernels
must all be resident at once (each rank waits for the others inside its launch), which ``num_sms // N`` CTAs a rank
of one CTA an SM are; a step that does not finish within ``timeout_s`` raises.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.weights import ModelWeights
from ..peers import alloc_peer_memory, inbox_elements
from ..plan import Constants, Tuning
from ..tensor_parallel import TensorParallel, place_shard, shard_cache
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
    the steps whose ranks' logits were not bit-identical (every rank gathers the same partials in rank order).
    ``replay`` reruns the last step from CUDA graphs without waiting on the host: what a timing measures."""

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
        self.graphs: list[torch.cuda.CUDAGraph] | None = None  # ``replay``'s, one a rank
        self.disagreements = 0

    def poison(self) -> None:
        """NaN in every rank's scratch and inboxes (nothing may read what this step did not write)."""
        for d in self.decoders:
            d.scratch.poison()
        self.memory.poison()

    def step(self, token: int, position: int, block_table: Sequence[int]) -> torch.Tensor:
        return self.step_batch([token], [position], [block_table])

    def _run(self, launches: Sequence, guard: bool) -> None:
        """``launches[r]()`` on rank r's stream, after the caller's stream's work, all in flight together; the
        caller's stream then waits for every rank. ``guard``: the host waits too, and raises past ``timeout_s``
        (ranks that are not all resident at once never finish)."""
        ready = torch.cuda.current_stream().record_event()
        for launch, s in zip(launches, self.streams):
            s.wait_event(ready)
            with torch.cuda.stream(s):
                launch()
        done = [s.record_event() for s in self.streams]
        start = time.monotonic()
        while guard and not all(e.query() for e in done):
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(f"the {len(self.decoders)} ranks' kernels did not finish in {self.timeout_s} s: "
                                   "not all resident at once, or a peer wait never met")
            time.sleep(1e-4)
        for e in done:
            torch.cuda.current_stream().wait_event(e)

    def step_batch(self, tokens: Sequence[int], positions: Sequence[int],
                   block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One launch of every rank (each its stream, all in flight together) -> rank 0's logits [B, V]."""
        for d in self.decoders:
            d.set_batch(tokens, positions, block_tables)
        self._run([d.launch for d in self.decoders], guard=True)
        logits = [d.scratch.logits for d in self.decoders]
        self.disagreements += int(not all(torch.equal(logits[0], x) for x in logits[1:]))
        return logits[0]

    def replay(self) -> None:
        """Every rank's step again over the inputs the last ``step_batch`` set, from one CUDA graph a rank (recorded
        on the first call, whose replay is guarded as ``step_batch`` is), all in flight together; the caller's stream
        waits for them, the host does not. A timing's step: ``step_batch``'s host wait and logit comparison would
        be most of what it measured."""
        first = self.graphs is None
        if first:
            if not all(d.inputs_set for d in self.decoders):
                raise RuntimeError("step_batch() must run before replay(): it sets the ranks' inputs")
            self.graphs = []
            for d in self.decoders:  # recorded, not run: a rank launched alone would wait for its peers forever
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    d.launch()
                self.graphs.append(g)
        self._run([g.replay for g in self.graphs], guard=first)

    def gather(self, cache: PagedKVCache | None = None) -> None:
        """Copy every rank's KV heads back into ``cache`` (default: the one the group was built from)."""
        cache = cache or self.cache
        for tp, d in zip(self.ranks, self.decoders):
            place_shard(cache, d.cache.page_tensors(), tp)


class DistributedRank:
    """This process's rank of a tensor-parallel group across GPUs (torch.distributed initialised, this process's GPU
    current): its decoder over its shard of ``weights`` (the whole model) and its ``cache`` shard, its inbox buffer
    and counter table in symmetric memory, linked to every rank's. ``step`` / ``step_batch``: every rank calls them
    with the same inputs, in the same order; each returns the whole vocabulary's logits (every rank's the same).
    Shares ``SharedGPUGroup``'s interface (``poison``, ``gather``, ``disagreements``) for tools/check.py."""

    def __init__(self, weights: ModelWeights, cache: PagedKVCache, max_pages_per_seq: int | None = None,
                 tuning: Tuning = Tuning(), num_sms: int | None = None, context_hint: int = 1024, batch: int = 1,
                 group=None):
        import os

        import torch.distributed as dist

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # (the project never uses multicast)
        from torch.distributed import _symmetric_memory as symm

        self.group = group or dist.group.WORLD
        if hasattr(symm, "enable_symm_mem_for_group"):  # (idempotent; the torch releases that need it first)
            symm.enable_symm_mem_for_group(self.group.group_name)
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.rank = TensorParallel(weights.spec, rank, size, tuning.resolve(weights.spec).tile_rows)
        self.decoder = d = MegakernelDecoder(weights, cache, max_pages_per_seq, tuning, num_sms, context_hint,
                                             batch=batch, tp=(rank, size))
        dev = cache.device
        box = symm.empty(inbox_elements(*inbox_shape(d.plan.constants)), dtype=torch.float32, device=dev)
        counters = symm.empty(d.state.counters.numel(), dtype=torch.int32, device=dev)
        box.fill_(float("nan"))
        counters.zero_()
        d.state.counters = counters  # the kernel's counter table, where the peers can add to it
        tables = [torch.tensor(symm.rendezvous(t, self.group).buffer_ptrs, dtype=torch.int64, device=dev)
                  for t in (box, counters)]
        d.link(*tables)
        self.box, self.disagreements = box, 0
        dist.barrier(self.group)  # every rank's tables exist before any rank's first launch

    def poison(self) -> None:
        """NaN in this rank's scratch and inbox, then a barrier (no peer's next step stores into it before)."""
        import torch.distributed as dist

        self.decoder.scratch.poison()
        self.box.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier(self.group)

    def step(self, token: int, position: int, block_table: Sequence[int]) -> torch.Tensor:
        return self.step_batch([token], [position], [block_table])

    def step_batch(self, tokens: Sequence[int], positions: Sequence[int],
                   block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """This rank's launch of the step (the peers launch theirs) -> the logits [B, V]; counts a step whose logits
        differ from rank 0's in ``disagreements`` (an all-gather)."""
        import torch.distributed as dist

        d = self.decoder
        d.set_batch(tokens, positions, block_tables)
        d.launch()
        logits = d.scratch.logits
        every = [torch.empty_like(logits) for _ in range(self.rank.size)]
        dist.all_gather(every, logits, group=self.group)
        self.disagreements += int(not all(torch.equal(every[0], x) for x in every[1:]))
        return logits

    def replay(self) -> None:
        """This rank's step again over the inputs the last ``step_batch`` set, from a CUDA graph (recorded on the
        first call: every rank calls it together, so the recording's warm-up launch meets its peers'), with no host
        wait and no comparison: a timing's step."""
        if self.decoder.graph is None:
            self.decoder.capture()
        self.decoder.run()

    def gather(self, cache: PagedKVCache) -> None:
        """Every rank's KV heads into ``cache`` (the whole model's heads), on every rank (all-gathers)."""
        import torch.distributed as dist

        mine = self.decoder.cache.page_tensors()
        every = [[torch.empty_like(t) for t in mine] for _ in range(self.rank.size)]  # [rank][pool]
        for i, t in enumerate(mine):
            dist.all_gather([pools[i] for pools in every], t.contiguous(), group=self.group)
        for r, pools in enumerate(every):
            place_shard(cache, pools, TensorParallel(self.rank.spec, r, self.rank.size, self.rank.tile_rows))


__all__ = ["inbox_shape", "link", "SharedGPUGroup", "DistributedRank"]
