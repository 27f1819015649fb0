"""The tensor-parallel VM: N ranks' programs run together on the CPU, as N GPUs would run their persistent kernels.

Each rank has its own program words (``build_program`` with ``ProgramConfig.tp = (rank, N)``), weight shard, KV
cache shard, step state, scratch and counter table; what they share is peer memory (``peers.PeerMemory``: every
rank's inboxes) and, through isa.PEER signals, each other's peer counters. A ``TPStepRun`` holds one ``StepRun``
per rank (vm.py: the counter semantics, cluster-pair rendezvous and data-readiness checks are the one-GPU VM's) and
interleaves instructions across every rank's SMs: the lowest (rank, SM) whose head may run, or, given an ``rng``, a
uniformly random one, so a rank may run arbitrarily far ahead of its peers wherever the counters let it. The ranks'
``Readiness`` share one ``readiness.InboxVersions``, which checks every inbox read (the REDUCE finds every rank's
partial of its layer) and every inbox store (it overwrites nothing its owner has not read yet). An unmet wait raises
``DependencyError``; no head ready on any rank before every queue finished raises ``DeadlockError``.

One step runs on every rank before the next starts on any (a launch per step on each GPU; across steps the inboxes
are safe by the argument in peers.py).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from ..kv.pages import PagedKVCache
from ..models.spec import ModelSpec
from ..models.weights import ModelWeights
from .peers import PeerMemory, alloc_peer_memory
from .program import Program, ProgramConfig, StepShape, build_program
from .readiness import InboxVersions
from .state import Scratch, StepState, alloc_scratch, alloc_state
from .tensor_parallel import TensorParallel, shard_cache, shard_weights
from .vm import VM, DeadlockError, StepRun

__all__ = ["TPVM", "TPStepRun", "TPDecoder"]


class TPVM:
    """Executes the N ranks' programs (``words[r]``, default: each program's own encoding) with the ops' solvers,
    rank r over ``weights[r]`` and ``caches[r]`` (its shards)."""

    def __init__(self, programs: list[Program], weights: list[ModelWeights], caches: list[PagedKVCache],
                 words: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        n = len(programs)
        if [p.config.tp for p in programs] != [(r, n) for r in range(n)]:
            raise ValueError(f"programs of ranks {[p.config.tp for p in programs]}: need ranks (0, {n}) .. "
                             f"({n - 1}, {n}) in order")
        if len(weights) != n or len(caches) != n or (words is not None and len(words) != n):
            raise ValueError(f"{n} programs need {n} weight shards, caches (and word sets)")
        self.programs = programs
        self.vms = [VM(p, w, c, None if words is None else words[r])
                    for r, (p, w, c) in enumerate(zip(programs, weights, caches))]

    @property
    def size(self) -> int:
        return len(self.vms)

    def alloc_peer_memory(self) -> PeerMemory:
        p = self.programs[0]
        return alloc_peer_memory(self.size, p.shape.num_tokens, p.spec.hidden_size, p.spec.vocab_size)

    def start(self, states: list[StepState], scratches: list[Scratch], memory: PeerMemory) -> "TPStepRun":
        return TPStepRun(self, states, scratches, memory)

    def run_step(self, states: list[StepState], scratches: list[Scratch], memory: PeerMemory,
                 rng: random.Random | None = None) -> None:
        """Run one step on every rank; on return each rank's scratch.logits holds the whole vocabulary's logits.
        If it raises, the counters are left mid-step, as aborted kernels would leave them."""
        run = self.start(states, scratches, memory)
        try:
            while not run.finished:
                run.run(run.pick(rng))
            run.check_complete()
        finally:
            run.sync_counters()


class TPStepRun:
    """One step in progress on every rank: a ``StepRun`` per rank, signalling each other's peer counters."""

    def __init__(self, tpvm: TPVM, states: list[StepState], scratches: list[Scratch], memory: PeerMemory):
        p = tpvm.programs[0]
        inbox = InboxVersions(tpvm.size, p.spec.hidden_size, p.spec.vocab_size)
        self.runs = [StepRun(vm, st, sc, memory.view(r), inbox)
                     for r, (vm, st, sc) in enumerate(zip(tpvm.vms, states, scratches))]
        for run in self.runs:
            run.peer_runs = self.runs

    @property
    def finished(self) -> bool:
        return all(run.finished for run in self.runs)

    def pick(self, rng: random.Random | None = None) -> tuple[int, int]:
        """(rank, SM) to run next: the lowest ready one, or a uniformly random ready one."""
        ready = [(r, s) for r, run in enumerate(self.runs) for s in run.ready]
        if not ready:
            blocked = [f"rank {r}: {run._describe_blocked()}" for r, run in enumerate(self.runs) if not run.finished]
            raise DeadlockError("no queue head may run on any rank:\n" + "\n".join(blocked))
        return min(ready) if rng is None else ready[rng.randrange(len(ready))]

    def run(self, at: tuple[int, int]) -> None:
        rank, sm = at
        self.runs[rank].run(sm)

    def check_complete(self) -> None:
        for run in self.runs:
            run.check_complete()

    def sync_counters(self) -> None:
        for run in self.runs:
            run.sync_counters()


class TPDecoder:
    """N ranks over the VM: plans each rank's program once for ``shape``, shards the weights and the KV cache
    (``cache`` holds every KV head, as one GPU's would; each rank gets a copy of its heads) and reuses them (and the
    never-reset counters) for every step."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cache: PagedKVCache, size: int, num_sms: int,
                 shape: StepShape, config: ProgramConfig | None = None):
        from .plan import Tuning  # the shipping program config for this shape unless one is given

        config = config or Tuning().resolve(spec).program_config()
        tps = [TensorParallel(spec, r, size, config.tile_rows) for r in range(size)]
        self.programs = [build_program(spec, shape, num_sms, dataclasses.replace(config, tp=(tp.rank, size)))
                         for tp in tps]
        self.caches = [shard_cache(cache, tp) for tp in tps]
        self.vm = TPVM(self.programs, [shard_weights(weights, tp) for tp in tps], self.caches)
        self.states = [alloc_state(p, max_pages=cache.layout.num_pages) for p in self.programs]
        self.scratches = [alloc_scratch(p) for p in self.programs]
        self.memory = self.vm.alloc_peer_memory()

    def step(self, tokens, seg_start_positions, block_tables, rng: random.Random | None = None) -> list[torch.Tensor]:
        """tokens [M]; each segment's first position and block table -> every rank's logits [M, V], rank order."""
        for st, p in zip(self.states, self.programs):
            st.fill(tokens, seg_start_positions, block_tables, p.shape.seg_lens)
        self.vm.run_step(self.states, self.scratches, self.memory, rng)
        return [sc.logits.clone() for sc in self.scratches]
