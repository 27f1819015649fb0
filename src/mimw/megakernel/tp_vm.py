"""The tensor-parallel VM: N ranks' programs run together on the CPU, as N GPUs would run their persistent kernels.

Each rank has its own program words (``build_program`` with ``ProgramConfig.tp = (rank, N)``), weight shard, KV
cache shard, step state, scratch and counter table; what they share is peer memory (``peers.PeerMemory``: every
rank's inboxes) and, through isa.PEER signals, each other's peer counters. A ``TPRun`` holds each rank's current
``StepRun`` (vm.py: the one-GPU counter semantics, cluster-pair rendezvous and data-readiness checks) and
interleaves instructions across every rank's SMs: the lowest (rank, SM) whose head may run, or, given an ``rng``, a
uniformly random one, so a rank runs as far ahead of its peers as the counters let it. Steps are launched per rank,
as N GPUs launch them: a rank that finished step k fills its state and starts step k + 1 at once, while a peer may
still be in step k (its peer counters then already hold the early signals: ``StepRun.peers_ahead``). The ranks'
``Readiness`` share one ``readiness.InboxVersions``, kept across steps, which checks every inbox read (the REDUCE
finds every rank's partial of its step and layer) and every store (it overwrites nothing its owner has not read).
An unmet wait raises ``DependencyError``; no head ready on any rank before every step finished, ``DeadlockError``.
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

__all__ = ["TPVM", "TPRun", "TPDecoder"]


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

    def start(self, states: list[StepState], scratches: list[Scratch], memory: PeerMemory, fills: list[tuple],
              inbox: InboxVersions | None = None) -> "TPRun":
        return TPRun(self, states, scratches, memory, fills, inbox)

    def run_steps(self, states: list[StepState], scratches: list[Scratch], memory: PeerMemory, fills: list[tuple],
                  rng: random.Random | None = None) -> "TPRun":
        """Run ``len(fills)`` steps on every rank (step k's inputs: ``StepState.fill(*fills[k])``); returns the
        finished run: ``run.logits[k][r]``, rank r's logits [M, V] of step k (the whole vocabulary). If it raises,
        the counters are left mid-step, as aborted kernels would leave them."""
        run = self.start(states, scratches, memory, fills)
        try:
            while not run.finished:
                run.run(run.pick(rng))
        finally:
            run.sync_counters()
        return run


class TPRun:
    """Steps in progress on every rank: each rank's current ``StepRun``, signalling each other's peer counters."""

    def __init__(self, tpvm: TPVM, states: list[StepState], scratches: list[Scratch], memory: PeerMemory,
                 fills: list[tuple], inbox: InboxVersions | None = None):
        p, n = tpvm.programs[0], tpvm.size
        self.tpvm, self.states, self.scratches, self.memory, self.fills = tpvm, states, scratches, memory, fills
        self.inbox = inbox or InboxVersions(n, p.spec.hidden_size, p.spec.vocab_size)
        self.step = [0] * n  # the step each rank is in (len(fills): done)
        self.lead = 0  # the most steps one rank has been ahead of another
        self.logits: list[list[torch.Tensor | None]] = [[None] * n for _ in fills]
        self.runs: list[StepRun] = []  # each rank's current step; the list the runs signal peers through
        for r in range(n):
            self.runs.append(self._start(r))

    def _start(self, rank: int) -> StepRun:
        """Rank ``rank``'s host fills its state and launches its next step."""
        self.states[rank].fill(*self.fills[self.step[rank]])
        run = StepRun(self.tpvm.vms[rank], self.states[rank], self.scratches[rank], self.memory.view(rank),
                      self.inbox)
        run.peer_runs, run.peers_ahead = self.runs, True
        return run

    @property
    def finished(self) -> bool:
        return all(k == len(self.fills) for k in self.step)

    def pick(self, rng: random.Random | None = None) -> tuple[int, int]:
        """(rank, SM) to run next: the lowest ready one, or a uniformly random ready one."""
        ready = [(r, s) for r, run in enumerate(self.runs) if self.step[r] < len(self.fills) for s in run.ready]
        if not ready:
            blocked = [f"rank {r} (step {self.step[r]}): {run._describe_blocked()}"
                       for r, run in enumerate(self.runs) if not run.finished]
            raise DeadlockError("no queue head may run on any rank:\n" + "\n".join(blocked))
        return min(ready) if rng is None else ready[rng.randrange(len(ready))]

    def run(self, at: tuple[int, int]) -> None:
        """Run the head of SM ``at[1]`` of rank ``at[0]``; a rank whose step ended checks it, hands its logits to
        its host and starts its next step."""
        rank, sm = at
        run = self.runs[rank]
        run.run(sm)
        if not run.finished:
            return
        run.check_complete()
        run.sync_counters()
        self.logits[self.step[rank]][rank] = self.scratches[rank].logits.clone()
        self.step[rank] += 1
        self.lead = max(self.lead, max(self.step) - min(self.step))
        if self.step[rank] < len(self.fills):
            self.runs[rank] = self._start(rank)

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
        self.lead = 0

    def steps(self, inputs: list[tuple], rng: random.Random | None = None) -> list[list[torch.Tensor]]:
        """Consecutive steps, each (tokens [M], each segment's first position, block tables), every rank launching
        its next step as soon as its own ended -> ``logits[k][r]``: rank r's logits [M, V] of step k."""
        seg_lens = self.programs[0].shape.seg_lens
        run = self.vm.run_steps(self.states, self.scratches, self.memory,
                                [(tokens, starts, tables, seg_lens) for tokens, starts, tables in inputs], rng)
        self.lead = run.lead  # the most steps one rank ran ahead of another
        return run.logits

    def step(self, tokens, seg_start_positions, block_tables, rng: random.Random | None = None) -> list[torch.Tensor]:
        """One step -> every rank's logits [M, V], rank order."""
        return self.steps([(tokens, seg_start_positions, block_tables)], rng)[0]
