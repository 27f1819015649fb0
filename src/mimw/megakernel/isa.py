"""The megakernel instruction set: one source of truth for opcodes, instruction fields and their int32 encoding.

A decode (or verify) step is a program: one queue of instructions per SM. Every instruction is encoded as
``NWORDS`` int32 words; word ``Word.X`` holds field X. The Gluon kernel decodes programs with the constants
exported by ``kernel_constants()`` (taken from the enums below), so the Python side and the GPU side cannot
drift apart. The PyTorch VM (``vm.py``) executes the same encoded words.

Dependencies are counters in global memory (``Word.WAIT``/``Word.WAIT_COUNT``): an instruction may start once
counter WAIT has reached ``(epoch + 1) * WAIT_COUNT`` (wrap-safe: ``int32(counter - target) >= 0``), and it adds 1
to counter ``Word.SIGNAL`` when its outputs are stored (release; ``Word.SIGNAL_N`` says how much: 1, or with merged
releases a run's total at its last instruction and 0 before it). An instruction may instead take an input as
versioned words (``Word.FLAGS``: ``READS_X``, ``READS_ACT``, ``READS_ATTN``, ``READS_Q``): then it also waits
until every word it reads carries the version that input must have for it (readiness.py numbers them), and their
producers (``WRITES_VERSIONED``) signal nothing. Every counter is signalled exactly ``WAIT_COUNT`` times per step,
so counters never need a reset launch: step number ``epoch`` simply waits for the next multiple (see
docs/megakernel.md).

Instructions (M = tokens in the step, D = hidden, hd = head_dim, G = query heads per KV head):
  ATTN_IN       y_part = RMSNorm(x)[cols] . W_qkv[head rows, cols] over one part of the columns -> qkv_part
                scratch; the LAST of the head's parts to finish (ticket counter ``Word.D``) sums the parts in part
                order, then (+bias) (+q/k RMSNorm) + RoPE; q heads -> q buffer, k/v heads -> appended to the paged
                KV cache at each token's position, and only it signals (``CLUSTER_PAIR``: no ticket, part 0
                finishes after the two parts swapped their sums on chip).              one head x M tokens x part
  ATTN_PARTIAL  softmax(q K^T) V over one split of one segment's context, for the G query heads
                of one KV head -> (o, m, l) partials. With ``combine`` set, the splits also do ATTN_REDUCE's
                work: the last split to finish (ticket counter ``Word.E``; a lone split needs none) combines the
                partials in split order and only it signals. With ``QKV_IN_ATTN`` it first finishes its heads
                from ATTN_IN's parts itself (the flag's comment below).                  (layer, kv head, seg, split)
  ATTN_REDUCE   combine the splits' partials -> attention output rows for the G heads     (layer, kv head, seg)
                (programs without ``combine``: one stage and one counter hop more).
  O_PROJ        x[rows] += W_o[rows] . attn                                                 a block of D rows
                With ``n_parts`` > 0 (ProgramConfig.o_parts) one column part of it, the columns of Hkv / n_parts
                KV groups: it combines those groups' attention splits itself (no ticket, no ATTN_REDUCE), and
                x_part[part, rows] = (part 0: x[rows] +) W_o[rows, part's columns] . attn[part's columns]; the
                readers of x after O_PROJ (MLP_IN, DOWN_PROJ) sum the parts in part order.
                                                                             a block of D rows x part
  MLP_IN        act[rows] = SiLU(W_gate[rows] . h) * (W_up[rows] . h), h = RMSNorm(x)      a block of I rows
  DOWN_PROJ     x[rows] += W_down[rows] . act                                               a block of D rows
  LM_HEAD       logits[rows] = W_lm[rows] . RMSNorm(x)                                      a block of vocab rows
Layer 0 reads the residual stream from the embedding row of each token instead of x (no separate embed pass).

Tickets (ATTN_IN split over its columns, so that a layer's few heads keep every SM streaming; ATTN_PARTIAL splits
that combine themselves): each part adds 1 to its ticket counter after storing its partial (acq_rel); the part that
brings it to ``(epoch + 1) * ticket_count`` is the last one and runs the finisher (ops.FINISHERS). The finisher
reads the parts in part order whoever runs it, so results do not depend on timing.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum
from typing import ClassVar

NWORDS = 14


class Op(IntEnum):
    NOP = 0
    ATTN_IN = 1
    ATTN_PARTIAL = 2
    ATTN_REDUCE = 3
    O_PROJ = 4
    MLP_IN = 5
    DOWN_PROJ = 6
    LM_HEAD = 7


# the ops whose instructions stream weight tiles through the ring (the GPU loader's instructions)
STREAMING_OPS = (Op.ATTN_IN, Op.O_PROJ, Op.MLP_IN, Op.DOWN_PROJ, Op.LM_HEAD)


class Word(IntEnum):
    """Position of each field in an encoded instruction."""

    OP = 0
    LAYER = 1
    A = 2  # ATTN_IN: head (q heads, then k heads, then v heads); PARTIAL/REDUCE: kv head; matvecs: first row
    B = 3  # ATTN_IN: column part; PARTIAL/REDUCE: segment; matvecs: number of rows
    C = 4  # ATTN_IN: number of column parts; PARTIAL: split index; O_PROJ: column part (with n_parts > 0)
    D = 5  # ATTN_IN: ticket counter (-1: one part, no ticket); PARTIAL/REDUCE: number of splits of the segment;
    #        O_PROJ: number of column parts (0: the whole row, after a combined attention)
    WAIT = 6  # counter to wait on, -1 for none
    WAIT_COUNT = 7  # signals that counter receives per step
    SIGNAL = 8  # counter to signal when done, -1 for none
    E = 9  # ATTN_PARTIAL: ticket counter of the combining splits (-1: none); O_PROJ with parts: the attention
    #        splits of each segment it combines
    F = 10  # ATTN_PARTIAL: 1 if the splits combine themselves (no ATTN_REDUCE follows)
    FLAGS = 11  # versioned-word bits: READS_X | READS_ACT | READS_ATTN | READS_Q | WRITES_VERSIONED; QKV_IN_ATTN;
    #             CLUSTER_PAIR; the GPU kernel's HOLD_ARRIVE | HOLD_WAIT
    G = 12  # ATTN_PARTIAL with QKV_IN_ATTN: ATTN_IN's column parts it sums (0 otherwise)
    SIGNAL_N = 13  # how much the release adds to SIGNAL: 1; with merged releases (ProgramConfig.merge_signals) the
    #                length of the run of same-counter instructions on this SM it ends, and 0 for the others


NO_COUNTER = -1

# Word.FLAGS: the residual stream x, the MLP activation act, the attention output attn, the query heads and the new
# K/V row as *versioned words* (the LL protocol of NCCL). Each element is one 64-bit word (version << 32 | fp32
# bits), stored single-copy atomic, so a reader that sees the version it expects also sees the value: no counter,
# no release fence, no poll (docs/megakernel.md).
READS_X = 1  # reads x (all of it, or its own rows) as versioned words and waits until they carry their version
READS_ACT = 2  # reads act as versioned words and waits likewise (DOWN_PROJ)
WRITES_VERSIONED = 4  # stores its outputs (x rows: O_PROJ, DOWN_PROJ; act: MLP_IN; attn: the combining
#                       ATTN_PARTIAL split or ATTN_REDUCE; q heads and the new K/V row: ATTN_IN's finisher, which
#                       still appends the row to the paged cache for later steps) as versioned words
READS_ATTN = 8  # reads the attention output as versioned words and waits likewise (O_PROJ)
READS_Q = 16  # reads its query heads, and (a split holding this step's position) the new K/V row, as versioned
#               words written by ATTN_IN's finishers, and waits likewise (ATTN_PARTIAL)
# Word.FLAGS, not a versioned-word bit: ATTN_IN's heads finished by their readers. ATTN_IN stores its column part and
# signals (no ticket, no finisher); each ATTN_PARTIAL sums the parts of its group's q heads and of its KV head's
# K and V heads itself (part order, bias, q/k RMSNorm, RoPE: the finisher's work, ops/attn_in.finish_rows), keeps
# q in registers, and stores this step's K/V rows that fall in its split to the paged cache before reading it.
# One counter hop's ticket and the finisher's round trips leave ATTN_IN; each split redoes G + 2 heads' finish.
QKV_IN_ATTN = 32
# Word.FLAGS, not a versioned-word bit: ATTN_IN's two column parts of a head run on the two CTAs of one thread-block
# cluster (SMs 2c and 2c + 1, the same ordinal among the paired instructions of both queues; ProgramConfig.
# cluster_qkv). Each part stores its partial into both CTAs' shared memory and arrives on the other's barrier; part
# 0 waits for part 1's, sums the two in part order and finishes the head (the ticketed finisher's math) and only it
# signals; part 1 also waits for part 0's before it moves on, so a slot is rewritten only after it was read
# (gpu/cluster.py). No ticket, no global round trip of partials. The pair is a rendezvous: part 0 cannot finish
# until its mate has run part 1 (the VM runs the two together). DOWN_PROJ pairs the same way (ProgramConfig.
# cluster_down): the two column halves of a row block, part 0 adding part 1's sums and the residual (``mate_key``).
CLUSTER_PAIR = 64
# Word.FLAGS, marks for the GPU kernel's release hold (KernelConfig.quiet; gpu/hold.py sets them on the encoded words
# from the program and the kernel's tiling, the VM ignores them): HOLD_ARRIVE, compute announces this instruction's
# release on the hold's mbarrier; HOLD_WAIT, the loader holds this instruction's tiles past the first ``quiet`` until
# the last announced release. Every announced release is waited for, so no barrier phase completes unwaited.
HOLD_ARRIVE = 128
HOLD_WAIT = 256


@dataclass(frozen=True)
class Instruction:
    """Base: scheduling fields shared by every instruction (filled in by the scheduler)."""

    OP: ClassVar[Op] = Op.NOP
    FIELDS: ClassVar[dict[str, Word]] = {}  # argument field -> the word that holds it
    wait: int = NO_COUNTER
    wait_count: int = 0
    signal: int = NO_COUNTER
    signal_n: int = 1  # what the release adds to ``signal`` (0: none, a later instruction of the run adds it)
    flags: int = 0  # READS_X | READS_ACT | READS_ATTN | READS_Q | WRITES_VERSIONED | QKV_IN_ATTN | CLUSTER_PAIR

    @property
    def has_finisher(self) -> bool:
        """Whether a part of this instruction (the last to draw its ticket) runs ops.FINISHERS[OP] after it."""
        return False

    def mate_key(self) -> tuple:
        """What the two parts of a cluster pair (CLUSTER_PAIR) share: op, layer and the unit they split (ATTN_IN's
        head, DOWN_PROJ's row block); the parts differ in ``part`` only."""
        raise ValueError(f"{self} does not run in cluster pairs")

    @property
    def ticket_count(self) -> int:
        """Parts that draw the ticket per step (1 when there is none)."""
        return 1

    def args(self) -> dict[int, int]:
        return {word: getattr(self, name) for name, word in self.FIELDS.items()}

    def encode(self) -> list[int]:
        w = [0] * NWORDS
        w[Word.OP] = int(self.OP)
        w[Word.WAIT], w[Word.WAIT_COUNT], w[Word.SIGNAL] = self.wait, self.wait_count, self.signal
        w[Word.SIGNAL_N] = self.signal_n
        w[Word.FLAGS] = self.flags
        for k, v in self.args().items():
            w[k] = int(v)
        return w


@dataclass(frozen=True)
class AttnIn(Instruction):
    OP: ClassVar[Op] = Op.ATTN_IN
    layer: int = 0
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "head": Word.A, "part": Word.B, "n_parts": Word.C,
                                         "ticket": Word.D}
    head: int = 0  # 0..Hq-1 query heads, Hq..Hq+Hkv-1 key heads, then value heads
    part: int = 0  # which of the n_parts column ranges (program.column_part) this instruction multiplies
    n_parts: int = 1
    ticket: int = NO_COUNTER  # counter the parts draw tickets from; the last part finishes the head

    @property
    def has_finisher(self) -> bool:
        if self.flags & CLUSTER_PAIR:  # part 0 of a cluster pair finishes the head, part 1 only hands its sums over
            return self.part == 0
        return not self.flags & QKV_IN_ATTN  # with QKV_IN_ATTN the ATTN_PARTIALs finish the heads they read

    @property
    def ticket_count(self) -> int:
        return self.n_parts

    def mate_key(self) -> tuple:
        return self.OP, self.layer, self.head, self.n_parts


@dataclass(frozen=True)
class AttnPartial(Instruction):
    OP: ClassVar[Op] = Op.ATTN_PARTIAL
    layer: int = 0
    kv_head: int = 0
    seg: int = 0
    split: int = 0
    n_splits: int = 1
    ticket: int = NO_COUNTER  # with combine and several splits: the counter the splits draw tickets from
    combine: int = 0  # 1: the last split combines the partials (ATTN_REDUCE's work) and signals
    n_parts: int = 0  # with QKV_IN_ATTN: ATTN_IN's column parts of each head, which this split sums itself
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "kv_head": Word.A, "seg": Word.B, "split": Word.C,
                                         "n_splits": Word.D, "ticket": Word.E, "combine": Word.F,
                                         "n_parts": Word.G}

    @property
    def has_finisher(self) -> bool:
        return bool(self.combine)

    @property
    def ticket_count(self) -> int:
        return self.n_splits


@dataclass(frozen=True)
class AttnReduce(Instruction):
    OP: ClassVar[Op] = Op.ATTN_REDUCE
    layer: int = 0
    kv_head: int = 0
    seg: int = 0
    n_splits: int = 1
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "kv_head": Word.A, "seg": Word.B, "n_splits": Word.D}


@dataclass(frozen=True)
class RowBlock(Instruction):
    """A matvec instruction over rows [row0, row0 + nrows) of one weight matrix, for every token of the step."""

    layer: int = 0
    row0: int = 0
    nrows: int = 0
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "row0": Word.A, "nrows": Word.B}


@dataclass(frozen=True)
class OProj(RowBlock):
    OP: ClassVar[Op] = Op.O_PROJ
    part: int = 0  # with n_parts > 0: which column part (KV groups [part, part + 1) * Hkv / n_parts)
    n_parts: int = 0  # 0: the whole row over the combined attention output (attn)
    n_splits: int = 0  # with n_parts > 0: the attention splits per segment whose partials it combines
    FIELDS: ClassVar[dict[str, Word]] = {**RowBlock.FIELDS, "part": Word.C, "n_parts": Word.D,
                                         "n_splits": Word.E}


@dataclass(frozen=True)
class MlpIn(RowBlock):
    OP: ClassVar[Op] = Op.MLP_IN


@dataclass(frozen=True)
class DownProj(RowBlock):
    OP: ClassVar[Op] = Op.DOWN_PROJ
    part: int = 0  # with n_parts 2 (a cluster pair, CLUSTER_PAIR; ProgramConfig.cluster_down): which column half
    n_parts: int = 0  # 0: every column of the rows, the residual added here
    FIELDS: ClassVar[dict[str, Word]] = {**RowBlock.FIELDS, "part": Word.C, "n_parts": Word.D}

    @property
    def has_finisher(self) -> bool:  # part 0 of a pair adds its mate's sums and the residual, and stores x
        return bool(self.flags & CLUSTER_PAIR) and self.part == 0

    def mate_key(self) -> tuple:
        return self.OP, self.layer, self.row0, self.nrows, self.n_parts


@dataclass(frozen=True)
class LmHead(RowBlock):
    OP: ClassVar[Op] = Op.LM_HEAD


@dataclass(frozen=True)
class Nop(Instruction):
    OP: ClassVar[Op] = Op.NOP


_BY_OP: dict[Op, type[Instruction]] = {
    c.OP: c for c in (Nop, AttnIn, AttnPartial, AttnReduce, OProj, MlpIn, DownProj, LmHead)
}


def decode(words) -> Instruction:
    """Inverse of ``Instruction.encode`` (words: any int sequence of length NWORDS)."""
    w = [int(x) for x in words]
    if len(w) != NWORDS:
        raise ValueError(f"an instruction has {NWORDS} words, got {len(w)}")
    try:
        cls = _BY_OP[Op(w[Word.OP])]
    except ValueError:
        raise ValueError(f"unknown opcode {w[Word.OP]}") from None
    common = dict(wait=w[Word.WAIT], wait_count=w[Word.WAIT_COUNT], signal=w[Word.SIGNAL], flags=w[Word.FLAGS],
                  signal_n=w[Word.SIGNAL_N])
    kwargs = {name: w[word] for name, word in cls.FIELDS.items()}
    return cls(**kwargs, **common)


def kernel_constants() -> dict[str, int]:
    """Constexpr values the Gluon kernel takes from this module: OP_<NAME>, W_<FIELD>, NWORDS, STREAMING (the
    bit mask 1 << op of STREAMING_OPS), and the release hold's marks HOLD_ARRIVE and HOLD_WAIT."""
    out = {f"OP_{o.name}": int(o) for o in Op}
    out["STREAMING"] = sum(1 << int(o) for o in STREAMING_OPS)
    out["HOLD_ARRIVE"], out["HOLD_WAIT"] = HOLD_ARRIVE, HOLD_WAIT
    out.update({f"W_{w.name}": int(w) for w in Word})
    out["NWORDS"] = NWORDS
    return out
