"""The PyTorch VM: runs an encoded megakernel program on the CPU, instruction by instruction, as the GPU would.

It is the proof of a program (every interleaving the counters allow computes the reference decoder's logits) and
the reference the Gluon kernel is diffed against (same words, same buffers, per-instruction solvers in ``ops/``).

Execution model, exactly the GPU's (isa.py, docs/megakernel.md):
  * SM ``s`` runs its queue ``words[s, :lengths[s]]`` in order; each instruction is decoded with ``isa.decode``.
  * ``epoch = counters[EPOCH]`` is read when the step starts. An instruction may run once
    ``counters[wait] >= (epoch + 1) * wait_count`` (wait == -1: at once); when it has stored its outputs it adds
    1 to ``counters[signal]``. An instruction with a ticket (ATTN_IN parts without cluster pairs, combining
    ATTN_PARTIAL splits, isa.py) first adds 1 to ``counters[ticket]``; only the part that brings it to
    ``(epoch + 1) * ticket_count`` runs the finisher and signals.
  * A cluster pair (``isa.CLUSTER_PAIR``: ATTN_IN's two parts of a head, or DOWN_PROJ's two column halves of a
    row block, on SMs 2c and 2c + 1) is a rendezvous: it runs once both SMs have it at their heads with their
    waits met, both parts together; then part 0 finishes (the head; the rows' sum and residual) and signals.
    Mates that reach different pairs raise ``DependencyError``.
  * Tensor parallelism (tp_vm.py runs N ranks' StepRuns together): an instruction flagged ``isa.PEER`` adds its 1 to
    counter ``signal`` of every rank (``StepRun.peer_runs``), as the GPU's remote atomics would.
  * A queue that has run out adds 1 to ``counters[DONE]``; the queue that brings DONE to ``(epoch + 1) * num_sms``
    adds 1 to ``counters[EPOCH]``. Counters are never reset: the next step waits for the next multiple.
  * Counters are int32 and wrap (atomic adds wrap in two's complement; so does ``(epoch + 1) * wait_count`` in
    int32 arithmetic). "Reached" is therefore the wrap-safe ``int32(counter - target) >= 0``, exact while a
    counter is less than 2^31 signals from its target, i.e. always: it moves by at most ``count`` per step.
    A plain ``counter >= target`` would go wrong after 2^31 / count steps (see docs/megakernel.md).
The VM interleaves the SMs one instruction at a time: the lowest-numbered SM whose head may run, or, given an
``rng``, a uniformly random one (a random interleaving). Running an instruction whose wait is unmet raises
``DependencyError`` (the scheduler never does; ``StepRun.run`` refuses when asked directly); a state where no head
may run before every queue finished raises ``DeadlockError``. Independently of the counters, ``Readiness`` checks
that every buffer region an instruction reads holds the data of the right layer, so a program with a missing
dependency fails in some interleaving even though its counters look consistent.
"""
from __future__ import annotations

import heapq
import random

import torch

from ..kv.pages import PagedKVCache
from ..models.spec import ModelSpec
from ..models.weights import ModelWeights
from . import isa
from .isa import Instruction
from .ops import CLASSES, FINISHERS, SOLVERS, OpContext
from .peers import PeerView
from .program import Program, ProgramConfig, StepShape, build_program
from .readiness import DependencyError, InboxVersions, Readiness
from .state import Scratch, StepState, alloc_scratch, alloc_state

__all__ = ["VM", "StepRun", "VMDecoder", "DependencyError", "DeadlockError", "i32"]


def i32(v: int) -> int:
    """v wrapped to int32, as the GPU's int32 arithmetic and atomics leave it."""
    return (v + 2**31) % 2**32 - 2**31


class DeadlockError(RuntimeError):
    """No queue head may run, yet some queue has not finished: the counters can never reach the waits' targets."""


class VM:
    """Executes ``words`` (default: ``program.encode()``; tests may pass edited words) with the ops' solvers.

    ``program`` supplies the model shape, the step shape and the counter names and per-step counts (for the
    end-of-step check and error messages); what runs, in which queue and with which waits, comes from the words."""

    def __init__(self, program: Program, weights: ModelWeights, cache: PagedKVCache,
                 words: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.program, self.weights, self.cache = program, weights, cache
        self.words, self.lengths = program.encode() if words is None else words  # [S, N, NWORDS], [S]
        if self.words.shape[0] != program.num_sms or self.words.shape[-1] != isa.NWORDS:
            raise ValueError(f"words {tuple(self.words.shape)} do not match {program.num_sms} SMs x NWORDS")
        # decoded once: the queues the VM runs come from the words, never from program.queues
        self.queues: list[list[Instruction]] = [
            [isa.decode(w, CLASSES) for w in self.words[s, : int(self.lengths[s])].tolist()]
            for s in range(program.num_sms)]

    def start(self, state: StepState, scratch: Scratch) -> "StepRun":
        return StepRun(self, state, scratch)

    def run_step(self, state: StepState, scratch: Scratch, rng: random.Random | None = None) -> None:
        """Run one whole step; on return scratch.logits holds the step's logits and the counters moved one epoch.
        If it raises, state.counters are left mid-step, as an aborted kernel would leave them."""
        run = self.start(state, scratch)
        try:
            while not run.finished:
                run.run(run.pick(rng))
            run.check_complete()
        finally:
            run.sync_counters()


class StepRun:
    """One step in progress: per-SM program counters, the counters (a host mirror of state.counters), readiness."""

    def __init__(self, vm: VM, state: StepState, scratch: Scratch, peers: PeerView | None = None,
                 inbox: InboxVersions | None = None):
        """``peers``, ``inbox``: this rank's view of peer memory and the ranks' shared inbox versions (a
        tensor-parallel step, tp_vm.py)."""
        prog = vm.program
        self.program, self.state = prog, state
        self.ctx = OpContext(prog, vm.weights, vm.cache, state, scratch, peers)
        self.readiness = Readiness(prog, state, scratch.routed, inbox, peers.rank if peers else 0)
        self.peer_runs: list[StepRun] = [self]  # every rank's current step, in rank order (tp_vm.py sets it)
        self.peers_ahead = False  # whether peers may already signal this rank's peer counters for the next step
        self.queues = vm.queues
        self.counters: list[int] = state.counters.tolist()  # int32 values
        self.done_i, self.epoch_i = state.done_index, state.epoch_index
        self.epoch = self.counters[self.epoch_i]
        self.pc = [0] * prog.num_sms
        self.ready: list[int] = []  # SMs whose head may run now
        self.signals = [0] * len(self.counters)  # signals each counter received in this step
        # counter -> heap of (signals[counter] at which the head may run, SM) of the SMs whose head waits on it
        self.blocked: dict[int, list[tuple[int, int]]] = {}
        self.pair_waiting: set[int] = set()  # SMs whose head (isa.CLUSTER_PAIR) may run but whose mate is not there
        self.unfinished = prog.num_sms
        for s in range(prog.num_sms):
            self._place(s)

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def head(self, sm: int) -> Instruction | None:
        q = self.queues[sm]
        return q[self.pc[sm]] if self.pc[sm] < len(q) else None

    def target(self, ins: Instruction) -> int:
        """The value counter ``ins.wait`` has when ins may run in this step: (epoch + 1) * wait_count, in int32."""
        return i32((self.epoch + 1) * ins.wait_count)

    def counter_met(self, ins: Instruction) -> bool:
        return ins.wait == isa.NO_COUNTER or i32(self.counters[ins.wait] - self.target(ins)) >= 0

    def pick(self, rng: random.Random | None = None) -> int:
        """The SM to run next: the lowest-numbered ready one, or a random ready one."""
        if not self.ready:
            raise DeadlockError(self._describe_blocked())
        return min(self.ready) if rng is None else self.ready[rng.randrange(len(self.ready))]

    # --- execution -----------------------------------------------------------------------------------------
    def run(self, sm: int) -> None:
        """Run the head instruction of SM ``sm``; refuse (DependencyError) if its wait is unmet."""
        ins = self.head(sm)
        if ins is None:
            raise ValueError(f"SM {sm} has finished its queue")
        if not self.counter_met(ins):
            raise DependencyError(f"SM {sm}: {ins} waits for counter {self._name(ins.wait)} to reach "
                                  f"{self.target(ins)}, it is {self.counters[ins.wait]}")
        if ins.flags & isa.CLUSTER_PAIR:  # a rendezvous: both parts run, then part 0 finishes and signals
            mate = sm ^ 1
            if mate not in self.ready or self.head(mate) is None or not self.head(mate).flags & isa.CLUSTER_PAIR:
                raise DependencyError(f"SM {sm}: {ins} waits for its cluster mate, SM {mate}")
            parts = sorted([(ins.part, sm, ins), (self.head(mate).part, mate, self.head(mate))])
            for _, _, part in parts:
                self.readiness.before(part)
                SOLVERS[part.OP](self.ctx, part)
                self.readiness.after(part)
            for _, s_, part in parts:
                self._finish_and_advance(s_, part)
            return
        self.readiness.before(ins)
        SOLVERS[ins.OP](self.ctx, ins)
        self.readiness.after(ins)
        self._finish_and_advance(sm, ins)

    def _finish_and_advance(self, sm: int, ins: Instruction) -> None:
        """After ins's solve on SM ``sm``: its finisher if it is the last part, its signal, the next head."""
        signal = ins.signal
        if ins.has_finisher:
            if self._last_part(ins):
                self.readiness.before_finish(ins)
                FINISHERS[ins.OP](self.ctx, ins)
                self.readiness.after_finish(ins)
            else:
                signal = isa.NO_COUNTER  # an earlier part: the last one finishes and signals
        self.ready.remove(sm)
        self.pc[sm] += 1
        if signal != isa.NO_COUNTER:
            for run in self.peer_runs if ins.flags & isa.PEER else (self,):
                run.receive(signal)
        self._place(sm)

    def receive(self, c: int) -> None:
        """A signal of counter ``c`` (from this rank, or a peer's isa.PEER instruction): add 1, wake its waiters."""
        self.counters[c] = i32(self.counters[c] + 1)
        self.signals[c] += 1
        waiting = self.blocked.get(c, [])
        while waiting and waiting[0][0] <= self.signals[c]:
            self._place(heapq.heappop(waiting)[1])

    def _last_part(self, ins) -> bool:
        """Draw ins's ticket (if it has one): is it the last of its ticket_count parts in this step?"""
        t = ins.ticket  # a cluster pair's part 0 finishes without one
        if t == isa.NO_COUNTER:
            return True
        self.counters[t] = i32(self.counters[t] + 1)
        self.signals[t] += 1
        return self.counters[t] == i32((self.epoch + 1) * ins.ticket_count)

    def _place(self, sm: int) -> None:
        """File SM ``sm`` as ready or blocked on its head's counter; count it done if its queue ran out."""
        ins = self.head(sm)
        if ins is None:
            self.unfinished -= 1
            self.counters[self.done_i] = i32(self.counters[self.done_i] + 1)
            if self.counters[self.done_i] == i32((self.epoch + 1) * self.program.num_sms):
                self.counters[self.epoch_i] = i32(self.counters[self.epoch_i] + 1)
        elif ins.flags & isa.CLUSTER_PAIR and self.counter_met(ins):  # ready once its mate is at the same pair
            mate = sm ^ 1
            if mate not in self.pair_waiting:
                self.pair_waiting.add(sm)
                return
            other = self.head(mate)
            if other.mate_key() != ins.mate_key() or other.part != 1 - ins.part:
                raise DependencyError(f"cluster mates disagree: SM {sm} holds {ins}, SM {mate} holds {other}")
            self.pair_waiting.remove(mate)
            self.ready += [sm, mate]
        elif self.counter_met(ins):
            self.ready.append(sm)
        else:
            c = ins.wait
            at = self.signals[c] + i32(self.target(ins) - self.counters[c])
            heapq.heappush(self.blocked.setdefault(c, []), (at, sm))

    def check_complete(self) -> None:
        """After the last queue: every counter was signalled exactly its per-step count, EPOCH moved by one, and
        every logit was written."""
        e = self.epoch + 1

        def off(i: int, c) -> bool:  # a peer counter may hold a peer's signals of the next step already
            lead = i32(self.counters[i] - e * c.count)
            return not 0 <= lead <= (c.count if c.peer and self.peers_ahead else 0)

        bad = [f"{c.name}={self.counters[i]} (expected {i32(e * c.count)})"
               for i, c in enumerate(self.program.counters) if off(i, c)]
        if self.counters[self.epoch_i] != i32(e) or self.counters[self.done_i] != i32(e * self.program.num_sms):
            bad.append(f"EPOCH={self.counters[self.epoch_i]}, DONE={self.counters[self.done_i]}")
        if bad:
            raise DependencyError("counters off their step-numbered targets after the step: " + ", ".join(bad))
        self.readiness.check_complete()

    def sync_counters(self) -> None:
        self.state.counters.copy_(torch.tensor(self.counters, dtype=torch.int32))

    def _name(self, c: int) -> str:
        return f"{c} ({self.program.counters[c].name})" if 0 <= c < len(self.program.counters) else str(c)

    def _describe_blocked(self) -> str:
        lines = [f"  SM {s}: {self.head(s)} waits for counter {self._name(c)} to reach "
                 f"{self.target(self.head(s))}, it is {self.counters[c]}"
                 for c, waiting in sorted(self.blocked.items()) for _, s in sorted(waiting)]
        lines += [f"  SM {s}: {self.head(s)} waits for its cluster mate, SM {s ^ 1}" for s in sorted(self.pair_waiting)]
        return f"deadlock in step (epoch {self.epoch}): no queue head may run, {self.unfinished} queues " \
               f"unfinished:\n" + "\n".join(lines[:20]) + ("\n  ..." if len(lines) > 20 else "")


class VMDecoder:
    """A decoder over the VM: plans the program once for ``shape`` and reuses it (and its never-reset counters)
    for every step."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cache: PagedKVCache, num_sms: int,
                 shape: StepShape, config: ProgramConfig | None = None):
        from .plan import Tuning  # the shipping program config for this shape unless one is given

        config = config or Tuning().resolve(spec).program_config()
        if config.tp[1] > 1:
            raise ValueError(f"a tensor-parallel config (rank, size = {config.tp}) runs on N ranks: "
                             "tp_vm.TPDecoder")
        self.program = build_program(spec, shape, num_sms, config)
        self.vm = VM(self.program, weights, cache)
        self.state = alloc_state(self.program, max_pages=cache.layout.num_pages)
        self.scratch = alloc_scratch(self.program)

    def step(self, tokens, seg_start_positions, block_tables, rng: random.Random | None = None) -> torch.Tensor:
        """tokens [M] (segments concatenated); each segment's first position and block table -> logits [M, V]."""
        self.state.fill(tokens, seg_start_positions, block_tables, self.program.shape.seg_lens)
        self.vm.run_step(self.state, self.scratch, rng)
        return self.scratch.logits.clone()
