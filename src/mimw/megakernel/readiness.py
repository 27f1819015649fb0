"""Data readiness within one step: which region of which buffer holds which layer's data, checked on every read.

The counters are the program's claim that an instruction runs only after the data it needs exists; this module
checks the claim independently. Every region of step data carries a *version*, the producer that last wrote it
during this step (-1: not written this step):

    x        [D]              2l+1 after layer l's O_PROJ of those columns, 2l+2 after its DOWN_PROJ
    down_part [P, D]          layer whose DOWN_PROJ column part p wrote those rows' sums (cluster pairs, ticketed
                              parts); the finisher
                              reads every part and writes x (2l+2)
    qkv_part [H, P]           layer whose ATTN_IN wrote part p of head h (H = Hq + 2 Hkv)
    q        [Hq]             layer whose ATTN_IN finished the head (all M tokens at once)
    kv       [L, 2, Hkv]      whether ATTN_IN stored this step's K (0) / V (1) positions of the layer's kv head
    part     [M, Hq, SPLITS]  layer whose ATTN_PARTIAL wrote (token, head, split)
    attn     [M, Hq]          layer whose combining ATTN_PARTIAL wrote (token, head)
    act      [I]              layer whose MLP_IN wrote the columns
    logits   [V]              1 once LM_HEAD (tensor parallelism: the gathering REDUCE) wrote the columns
  Tensor parallelism (``InboxVersions``, shared by the ranks, kept across steps): every rank's inboxes (peers.py),
  per (kind, src, column), the (step, layer) whose partial rank src stored there and whether the owner's REDUCE
  read it; a PEER-flagged O_PROJ / DOWN_PROJ writes no x (its REDUCE does: 2l+1, 2l+2), a PEER-flagged LM_HEAD no
  logits (the gathering REDUCE writes every shard's).
  MoE layers (x: 2l+2 after the layer's EXPERT_DOWN finishers, as after DOWN_PROJ):
    rlogits  [Ep]             layer whose ROUTER part wrote the columns (the finisher reads the first E)
    routed   [L]              whether layer l's ROUTER finisher wrote its routing table row this step
    slot_w   [S]              layer whose ROUTER finisher wrote the slot's weights
    moe_act  [S, F]           layer whose EXPERT_IN of the slot wrote the columns
    moe_part [S, D]           layer whose EXPERT_DOWN of the slot wrote the rows
  An expert instruction whose slot holds no expert this step (isa.NO_EXPERT) reads and writes nothing but the
  routing entry; a finisher reads only the slots in use (their weights and rows).

An instruction must find every region it reads at exactly the version its layer needs. Too old (or -1) is a
read-after-write race: the producer has not run. Too new is a write-after-read race: a later layer's producer
already overwrote the buffer this instruction still needed (buffers are reused by every layer). Either raises
``DependencyError``. K/V positions from earlier steps are always ready: only this step's positions are tracked.
"""
from __future__ import annotations

import numpy as np

from .isa import NO_COUNTER, NO_EXPERT, PEER, Instruction, Op, routed_expert
from .peers import DOWN_SUM, INBOX_NAMES, LM_GATHER, O_SUM
from .program import Program
from .state import StepState, split_range
from .tiles import router_rows


class DependencyError(RuntimeError):
    """An instruction would run before the data it reads is ready (or after it was overwritten)."""


class Readiness:
    def __init__(self, program: Program, state: StepState, routing=None, inbox: "InboxVersions | None" = None,
                 rank: int = 0):
        """``routing``: the step's routing table (scratch.routed [L, S] int32), which tells which expert slots
        are in use; needed for MoE programs only. ``inbox``, ``rank``: the ranks' shared inbox versions and this
        rank's number, for a tensor-parallel program."""
        sp, shape = program.spec, program.shape
        self.program, self.state = program, state
        m, full = shape.num_tokens, lambda *s: np.full(s, -1, dtype=np.int32)  # noqa: E731
        self.x = full(sp.hidden_size)
        self.down_part = full(max(2, program.down_parts), sp.hidden_size)
        self.qkv_part = full(sp.num_heads + 2 * sp.num_kv_heads, program.qkv_parts)
        self.q = full(sp.num_heads)
        self.kv = np.zeros((sp.num_layers, 2, sp.num_kv_heads), dtype=bool)
        self.part = full(m, sp.num_heads, program.max_splits)
        self.attn = full(m, sp.num_heads)
        self.act = full(sp.intermediate_size)
        self.logits = full(program.logits_width)
        self.inbox, self.rank, self.epoch = inbox, rank, state.epoch  # the step's epoch, read at its start
        s = program.moe_slots
        self.rlogits = full(router_rows(sp, program.config.tile_rows) if sp.is_moe else 0)
        self.routed = np.zeros(sp.num_layers, dtype=bool)
        self.slot_w = full(s)
        self.moe_act = full(s, sp.moe_intermediate_size)
        self.moe_part = full(s, sp.hidden_size)
        self.routing = routing

    def _expert(self, ins) -> int:
        """The expert ``ins``'s routing slot holds, once its layer's router wrote the table (else DependencyError:
        the instruction would read a stale entry)."""
        if not self.routed[ins.layer]:
            raise DependencyError(f"{ins} reads routing slot {ins.slot} of layer {ins.layer} before the layer's "
                                  "ROUTER finisher wrote it")
        return routed_expert(int(self.routing[ins.layer, ins.slot]), self.state.epoch)

    def _active(self, layer: int, n_slots: int) -> list[int]:
        return [j for j in range(n_slots)
                if routed_expert(int(self.routing[layer, j]), self.state.epoch) != NO_EXPERT]

    # --- regions ---------------------------------------------------------------------------------------
    def _group(self, kv_head: int) -> slice:
        g = self.program.spec.group_size
        return slice(kv_head * g, (kv_head + 1) * g)

    def _query(self, ins) -> slice:
        """An attention instruction's query tokens (its segment's, or its query block's)."""
        return self.program.shape.query_tokens(ins.seg, ins.tokens)

    def _context(self, ins) -> int:
        return int(self.state.seg_ctx[ins.seg + ins.tokens - 1])

    def _split(self, ins) -> tuple[int, int]:
        q = self._query(ins)
        return split_range(self._context(ins), ins.split, ins.n_splits, q.stop - q.start)

    def _require(self, ins: Instruction, what: str, ver: np.ndarray, want: int) -> None:
        if not bool((ver == want).all()):
            got = sorted({int(v) for v in ver.ravel().tolist()} - {want})
            raise DependencyError(f"{ins} reads {what} at version {got}, needs version {want} "
                                  f"(-1: not written this step; see readiness.py for the numbering)")

    # --- the contract ------------------------------------------------------------------------------------
    def before(self, ins: Instruction) -> None:
        """Raise DependencyError unless everything ``ins`` reads holds the version it needs."""
        op = ins.OP
        if op == Op.NOP:
            return
        L = ins.layer
        every = slice(0, self.program.spec.hidden_size)
        if op == Op.ATTN_IN:
            if L > 0:  # layer 0 normalises the embedding rows
                self._require(ins, "x", self.x[every], 2 * L)
        elif op in (Op.MLP_IN, Op.ROUTER):
            self._require(ins, "x", self.x[every], 2 * L + 1)
        elif op == Op.EXPERT_IN:
            if self._expert(ins) != NO_EXPERT:
                self._require(ins, "x", self.x[every], 2 * L + 1)
        elif op == Op.EXPERT_DOWN:
            if self._expert(ins) != NO_EXPERT:
                self._require(ins, "expert activations", self.moe_act[ins.slot], L)
                self._require(ins, "slot weights", self.slot_w[ins.slot: ins.slot + 1], L)
        elif op == Op.LM_HEAD:
            self._require(ins, "x", self.x[every], 2 * self.program.spec.num_layers)
        elif op == Op.ATTN_PARTIAL:
            lo, hi = self._split(ins)
            if lo == hi:
                return  # an empty split only writes its (EMPTY_M, 0, 0) partial
            self._require(ins, "q heads", self.q[self._group(ins.kv_head)], L)
            q = self._query(ins)
            new_lo = self._context(ins) - (q.stop - q.start)
            if hi > new_lo and not self.kv[L, :, ins.kv_head].all():
                raise DependencyError(f"{ins} reads this step's K/V positions [{max(lo, new_lo)}, {hi}) of "
                                      f"kv head {ins.kv_head} before ATTN_IN stored them")
        elif op == Op.O_PROJ:
            self._require(ins, "attn", self.attn, L)
            if ins.flags & PEER:  # the rank's partial, no residual
                self._check_store(ins, O_SUM)
            elif L > 0:
                self._require(ins, "x rows", self.x[ins.row0: ins.row0 + ins.nrows], 2 * L)
        elif op == Op.DOWN_PROJ:
            self._require(ins, "act", self.act, L)
            if ins.n_parts and (ins.part or ins.ticket != NO_COUNTER):  # a pair's part 1 or a ticketed part: its
                return  # columns only; the residual is the finisher's
            if ins.flags & PEER:
                if not ins.n_parts:  # whole rows store their partial now (parts: in the finisher)
                    self._check_store(ins, DOWN_SUM)
                return
            self._require(ins, "x rows", self.x[ins.row0: ins.row0 + ins.nrows], 2 * L + 1)
        elif op == Op.REDUCE:
            rows = slice(ins.row0, ins.row0 + ins.nrows)
            self.inbox.check_read(str(ins), self.rank, ins.kind, rows, self.epoch, L)
            if ins.kind == O_SUM and L > 0:
                self._require(ins, "x rows", self.x[rows], 2 * L)
            elif ins.kind == DOWN_SUM:
                self._require(ins, "x rows", self.x[rows], 2 * L + 1)
        if op == Op.LM_HEAD and ins.flags & PEER:
            self._check_store(ins, LM_GATHER)

    def _check_store(self, ins: Instruction, kind: int) -> None:
        if self.inbox is None:
            raise DependencyError(f"{ins} stores into the peers' {INBOX_NAMES[kind]} inbox outside a "
                                  "tensor-parallel step")
        self.inbox.check_store(str(ins), self.rank, kind, slice(ins.row0, ins.row0 + ins.nrows))

    def after(self, ins: Instruction) -> None:
        """Record what ``ins`` wrote."""
        op = ins.OP
        if op == Op.ATTN_IN:
            self.qkv_part[ins.head, ins.part] = ins.layer
        elif op == Op.ATTN_PARTIAL:
            self.part[self._query(ins), self._group(ins.kv_head), ins.split] = ins.layer
        elif op == Op.DOWN_PROJ and ins.n_parts:  # a pair's half: x is written by part 0's finish
            self.down_part[ins.part, ins.row0: ins.row0 + ins.nrows] = ins.layer
        elif op in (Op.O_PROJ, Op.DOWN_PROJ, Op.LM_HEAD) and ins.flags & PEER:
            kind = {Op.O_PROJ: O_SUM, Op.DOWN_PROJ: DOWN_SUM, Op.LM_HEAD: LM_GATHER}[op]
            self.inbox.stored(self.rank, kind, slice(ins.row0, ins.row0 + ins.nrows), self.epoch, ins.layer)
        elif op in (Op.O_PROJ, Op.DOWN_PROJ):
            self.x[ins.row0: ins.row0 + ins.nrows] = 2 * ins.layer + (1 if op == Op.O_PROJ else 2)
        elif op == Op.MLP_IN:
            self.act[ins.row0: ins.row0 + ins.nrows] = ins.layer
        elif op == Op.LM_HEAD:
            self.logits[ins.row0: ins.row0 + ins.nrows] = 1
        elif op == Op.REDUCE and ins.kind == LM_GATHER:  # every shard's columns of these rows
            vn = self.program.spec.vocab_size
            for src in range(ins.n_ranks):
                self.logits[src * vn + ins.row0: src * vn + ins.row0 + ins.nrows] = 1
        elif op == Op.REDUCE:
            self.x[ins.row0: ins.row0 + ins.nrows] = 2 * ins.layer + (1 if ins.kind == O_SUM else 2)
        elif op == Op.ROUTER:
            self.rlogits[ins.row0: ins.row0 + ins.nrows] = ins.layer
        elif op == Op.EXPERT_IN and self._expert(ins) != NO_EXPERT:
            self.moe_act[ins.slot, ins.row0: ins.row0 + ins.nrows] = ins.layer
        elif op == Op.EXPERT_DOWN and self._expert(ins) != NO_EXPERT:
            self.moe_part[ins.slot, self._rows(ins)] = ins.layer

    def _rows(self, ins) -> slice:
        return ins.rows(self.program.config.tile_rows)

    def before_finish(self, ins: Instruction) -> None:
        """A finisher reads every part: ATTN_IN's, every part of its head; a combining ATTN_PARTIAL's, every split's
        partials of its segment and group; a DOWN_PROJ pair's part 0, both halves."""
        if ins.OP == Op.ATTN_PARTIAL:
            self._require(ins, "partials",
                          self.part[self._query(ins), self._group(ins.kv_head), : ins.n_splits], ins.layer)
        elif ins.OP == Op.DOWN_PROJ:
            rows = slice(ins.row0, ins.row0 + ins.nrows)
            self._require(ins, "column parts", self.down_part[: ins.n_parts, rows], ins.layer)
            if ins.flags & PEER:  # the parts' sum is the rank's partial, no residual
                self._check_store(ins, DOWN_SUM)
            else:
                self._require(ins, "x rows", self.x[rows], 2 * ins.layer + 1)
        elif ins.OP == Op.ROUTER:
            self._require(ins, "router logits", self.rlogits[: self.program.spec.num_experts], ins.layer)
        elif ins.OP == Op.EXPERT_DOWN:
            rows = self._rows(ins)
            active = self._active(ins.layer, ins.n_slots)
            self._require(ins, "slot weights", self.slot_w[active], ins.layer)
            self._require(ins, "expert rows", self.moe_part[active, rows], ins.layer)
            self._require(ins, "x rows", self.x[rows], 2 * ins.layer + 1)
        else:
            self._require(ins, "qkv parts", self.qkv_part[ins.head, : ins.n_parts], ins.layer)

    def after_finish(self, ins: Instruction) -> None:
        hq, hkv = self.program.spec.num_heads, self.program.spec.num_kv_heads
        if ins.OP == Op.ATTN_PARTIAL:
            self.attn[self._query(ins), self._group(ins.kv_head)] = ins.layer
        elif ins.OP == Op.DOWN_PROJ and ins.flags & PEER:
            self.inbox.stored(self.rank, DOWN_SUM, slice(ins.row0, ins.row0 + ins.nrows), self.epoch, ins.layer)
        elif ins.OP == Op.DOWN_PROJ:
            self.x[ins.row0: ins.row0 + ins.nrows] = 2 * ins.layer + 2
        elif ins.OP == Op.ROUTER:
            self.routed[ins.layer] = True
            self.slot_w[:] = ins.layer
        elif ins.OP == Op.EXPERT_DOWN:
            self.x[self._rows(ins)] = 2 * ins.layer + 2
        elif ins.head < hq:
            self.q[ins.head] = ins.layer
        else:
            self.kv[ins.layer, (ins.head - hq) // hkv, (ins.head - hq) % hkv] = True

    def check_complete(self) -> None:
        """At the end of a step every logit must have been written (the host reads them all)."""
        if not (self.logits == 1).all():
            missing = int((self.logits != 1).sum())
            raise DependencyError(f"the step ended with {missing} logits columns never written")


class InboxVersions:
    """Readiness of every rank's inboxes (readiness.py's idea, across ranks and steps): for each (rank, kind, src,
    column) the (step, layer) whose partial rank src stored there last (none: never) and whether the owner's REDUCE
    has read it. Shared by the ranks' ``Readiness`` objects, kept across steps: a rank may start its next step while
    a peer is still in this one (tp_vm.py)."""

    def __init__(self, size: int, hidden: int, vocab_shard: int):
        widths = (hidden, hidden, vocab_shard)
        self.ver = [[np.full((size, w), -1, dtype=np.int64) for w in widths] for _ in range(size)]
        self.read = [[np.zeros((size, w), dtype=bool) for w in widths] for _ in range(size)]

    @staticmethod
    def version(epoch: int, layer: int) -> int:
        return (epoch & 0xFFFFFFFF) << 20 | layer

    @staticmethod
    def _describe(versions) -> str:
        return ", ".join("never" if v < 0 else f"step {v >> 20} layer {v & 0xFFFFF}" for v in sorted(set(versions)))

    def check_store(self, what: str, src: int, kind: int, rows: slice) -> None:
        """Before rank ``src`` stores rows of inbox ``kind`` on every rank: each region must be never written or
        already read (else the store overwrites a partial its owner still needs)."""
        for dst in range(len(self.ver)):
            unread = (self.ver[dst][kind][src, rows] >= 0) & ~self.read[dst][kind][src, rows]
            if unread.any():
                got = self._describe(self.ver[dst][kind][src, rows][unread].tolist())
                raise DependencyError(f"{what} on rank {src} overwrites rank {dst}'s {INBOX_NAMES[kind]} inbox "
                                      f"({got}) before its REDUCE read it")

    def stored(self, src: int, kind: int, rows: slice, epoch: int, layer: int) -> None:
        for dst in range(len(self.ver)):
            self.ver[dst][kind][src, rows] = self.version(epoch, layer)
            self.read[dst][kind][src, rows] = False

    def check_read(self, what: str, dst: int, kind: int, rows: slice, epoch: int, layer: int) -> None:
        """Rank ``dst``'s REDUCE of ``rows`` in step ``epoch``: every rank's partial of ``layer`` must be there."""
        want, got = self.version(epoch, layer), self.ver[dst][kind][:, rows]
        if not (got == want).all():
            missing = sorted({int(s) for s in np.nonzero((got != want).any(axis=1))[0]})
            raise DependencyError(f"{what} on rank {dst} reads the {INBOX_NAMES[kind]} inbox's slots of ranks "
                                  f"{missing} at {self._describe(got[got != want].tolist())}, needs step "
                                  f"{epoch & 0xFFFFFFFF} layer {layer}")
        self.read[dst][kind][:, rows] = True
