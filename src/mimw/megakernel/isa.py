"""The megakernel instruction set: opcodes, the int32 word layout of an instruction, and its flags.

A step is a program: one queue of instructions per SM. Every instruction is ``NWORDS`` int32 words; word
``Word.X`` holds field X. The Gluon kernel decodes programs with the constants of ``kernel_constants()``, taken from
the enums below, and the PyTorch VM (``vm.py``) runs the same words, so host and device cannot drift apart. The
instructions themselves (their fields, the tiles they stream, their cost, their reference solver and their device
code) live one module per instruction in ``ops/``; ``ops.OPS`` is the table.

Dependencies are counters in global memory: an instruction may start once counter ``Word.WAIT`` has reached
``(epoch + 1) * Word.WAIT_COUNT`` (wrap-safe: ``int32(counter - target) >= 0``), and it adds 1 to counter
``Word.SIGNAL`` when its outputs are stored (release). Every counter is signalled exactly ``WAIT_COUNT`` times per
step, so counters never need a reset launch: step number ``epoch`` waits for the next multiple (docs/megakernel.md).

Tickets: the parts of one result (ATTN_IN's column parts of a head without cluster pairs, the attention splits of a
KV group) each add 1 to a ticket counter after storing their partial (acq_rel); the part that brings it to
``(epoch + 1) * parts`` is the last and runs the instruction's finisher (its ``finish``), reading the parts in part
order whoever runs it, so results do not depend on timing.

Weight tiles: every instruction that streams weights names its tiles in the words (``Word.T0`` .. ``Word.KT``,
``TileSpan``): row tiles ``r < NR`` and column tiles ``K0 <= k < K1`` of one matrix stored tile-major with ``KT``
column tiles per row tile, tile (r, k) being number ``T0 + r * KT + k`` of the packed weight tile array
(host/pack.py). The loader streams exactly that walk and compute consumes it in the same order; the scheduler's cost
model and the host's hold marks read the same span (``ops/<op>.span``).

Expert spans (``EXPERT_SPAN``, the MoE instructions EXPERT_IN and EXPERT_DOWN): which expert's tiles an instruction
streams is known only once the step's router has run. Its words name expert 0's tiles (T0 .. KT as above) and the
expert stride ``Word.E`` (``XS_WORD``: tiles per expert of that matrix); expert e's tile (r, k) is number
``T0 + e * XS + r * KT + k``. The expert is the entry of the step's routing table ``routed [L, S]`` (int32 scratch)
at row ``Word.LAYER``, column ``Word.C`` (``SLOT_WORD``, the routing slot; S = ``Program.moe_slots``), which the
layer's ROUTER finisher writes as ``route_entry(e, epoch)``: the expert id in the low 16 bits (``NO_EXPERT``: the
slot is unused this step, the instruction streams and computes nothing) and a tag of the step's epoch above, so a
reader that finds a stale entry (the previous step's, or never written) knows to look again: ``routed_expert``.
The loader resolves such a span by polling its one entry (no counter: the entry carries its own readiness) and then
walks ``TileSpan.for_expert(e)``; compute reads the same entry after its dependency wait.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

NWORDS = 16


class Op(IntEnum):
    NOP = 0
    ATTN_IN = 1
    ATTN_PARTIAL = 2
    O_PROJ = 3
    MLP_IN = 4
    DOWN_PROJ = 5
    LM_HEAD = 6
    ROUTER = 7
    EXPERT_IN = 8
    EXPERT_DOWN = 9
    REDUCE = 10  # tensor parallelism: the ranks' partials summed (or the logits gathered) from this rank's inbox


class Word(IntEnum):
    """Position of each field in an encoded instruction."""

    OP = 0
    LAYER = 1
    A = 2  # ATTN_IN: head (q heads, then k heads, then v heads); ATTN_PARTIAL: kv head; matvecs: first row
    B = 3  # ATTN_IN: column part; ATTN_PARTIAL: segment in the low PACK_SHIFT bits, its query block's segments
    #        less 1 above (PACKED); matvecs: number of rows; EXPERT_DOWN: routing slots
    C = 4  # ATTN_IN: number of column parts; ATTN_PARTIAL: split; DOWN_PROJ: column half (cluster pair);
    #        ROUTER: number of parts; EXPERT_IN, EXPERT_DOWN: routing slot (SLOT_WORD); REDUCE: inbox
    D = 5  # ATTN_IN: ticket counter (-1: none); ATTN_PARTIAL: number of splits; DOWN_PROJ: halves (0 or 2);
    #        ROUTER, EXPERT_DOWN: ticket counter (-1: none); REDUCE: number of ranks
    E = 6  # ATTN_PARTIAL: ticket counter of the combining splits (-1: a lone split); EXPERT_SPAN: expert stride
    WAIT = 7  # counter to wait on, -1 for none
    WAIT_COUNT = 8  # signals that counter receives per step
    SIGNAL = 9  # counter to signal when done, -1 for none
    FLAGS = 10  # CLUSTER_PAIR; the GPU kernel's HOLD_ARRIVE | HOLD_WAIT
    T0 = 11  # weight tiles (TileSpan): the first tile's number in the packed tile array
    NR = 12  # row tiles (0: the instruction streams no weights)
    K0 = 13  # first column tile
    K1 = 14  # end of the column tiles
    KT = 15  # column tiles per row tile of the matrix (the tile number's row stride)


NO_COUNTER = -1
# Instruction.PACKED: a field kept above bit PACK_SHIFT of a word whose low bits hold another field, stored less its
# bias (a field at its usual value, the bias, leaves the word as the low field alone)
PACK_SHIFT = 16

# Word.FLAGS: the two parts of a result run on the two CTAs of one thread-block cluster (SMs 2c and 2c + 1, the same
# ordinal among the paired instructions of both queues): ATTN_IN's two column parts of a head, DOWN_PROJ's two column
# halves of a row block. Each part stores its sums into both CTAs' shared memory; part 0 waits for part 1's, finishes
# the result (the ticketed finisher's math, in part order) and alone signals (device/cluster.py). No ticket, no
# global round trip of partials. The pair is a rendezvous: the VM runs the two parts together.
CLUSTER_PAIR = 1
# Word.FLAGS, marks of the GPU kernel's release hold (host/hold.py sets them; the VM ignores them): HOLD_ARRIVE,
# compute announces this instruction's release on the hold's mbarrier; HOLD_WAIT, the loader holds this instruction's
# tiles past the first ``quiet`` until the last announced release.
HOLD_ARRIVE = 2
HOLD_WAIT = 4
# Word.FLAGS: the span names expert 0's tiles, the expert is read from the routing table at run time (module doc)
EXPERT_SPAN = 8
XS_WORD = Word.E  # an expert span's stride: tiles per expert (ops with an expert span keep Word.E for it)
SLOT_WORD = Word.C  # an expert span's routing slot: routed[layer, slot]
# Word.FLAGS, tensor parallelism (docs/megakernel.md, "Tensor parallelism"): the instruction's result is this rank's
# partial (O_PROJ, DOWN_PROJ: no residual; LM_HEAD: its vocabulary rows), stored into every rank's inbox (peer
# memory, megakernel/peers.py), and its signal goes to counter ``Word.SIGNAL`` of every rank (a peer counter:
# program.Counter.peer), the same index in every rank's table, each add a system-scope release
PEER = 16

# routing table entries (module doc): expert id in the low ROUTE_BITS bits, the step's tag above
ROUTE_BITS = 16
NO_EXPERT = (1 << ROUTE_BITS) - 1  # an unused routing slot
_TAG_MASK = (1 << 14) - 1
_TAG_SET = 1 << 14  # always set in a tag, so a never-written (zero) entry matches no step


def route_tag(epoch: int) -> int:
    """The tag of step ``epoch``'s routing entries: 15 bits, never 0, different in consecutive steps."""
    return (epoch & _TAG_MASK) | _TAG_SET


def route_entry(expert: int, epoch: int) -> int:
    """The int32 routing-table entry step ``epoch`` stores for ``expert`` (``NO_EXPERT``: an unused slot)."""
    if not 0 <= expert <= NO_EXPERT:
        raise ValueError(f"expert {expert} out of range")
    return (route_tag(epoch) << ROUTE_BITS) | expert


def routed_expert(entry: int, epoch: int) -> int | None:
    """The expert of a routing-table entry as step ``epoch`` reads it: its id, ``NO_EXPERT``, or None when the
    entry is stale (not yet written by this step's router: a reader polls again)."""
    if entry >> ROUTE_BITS != route_tag(epoch):
        return None
    return entry & NO_EXPERT


@dataclass(frozen=True)
class TileSpan:
    """The weight tiles an instruction streams, in loader order: row tile by row tile, column tiles [k0, k1) of
    each; tile (r, k) is number ``t0 + r * kt + k`` of the packed tile array. An expert span (``xs`` > 0, the
    instruction flagged ``EXPERT_SPAN``) names expert 0's tiles; expert e's are ``for_expert(e)``."""

    t0: int = 0
    nr: int = 0
    k0: int = 0
    k1: int = 0
    kt: int = 0
    xs: int = 0  # expert stride in tiles (0: a span fixed at plan time)

    @property
    def n_tiles(self) -> int:
        """Tiles streamed (an expert span: by a slot in use, the same for every expert)."""
        return self.nr * (self.k1 - self.k0)

    def for_expert(self, expert: int) -> "TileSpan":
        """The resolved span of ``expert`` (``NO_EXPERT``: nothing streamed)."""
        if expert == NO_EXPERT:
            return TileSpan()
        return TileSpan(self.t0 + expert * self.xs, self.nr, self.k0, self.k1, self.kt)

    def tiles(self) -> list[int]:
        """The tile numbers in loader order (a resolved span)."""
        return [self.t0 + r * self.kt + k for r in range(self.nr) for k in range(self.k0, self.k1)]


@dataclass(frozen=True)
class Instruction:
    """Base: scheduling fields shared by every instruction (filled in by the scheduler) and its weight tiles."""

    OP: ClassVar[Op] = Op.NOP
    FIELDS: ClassVar[dict[str, Word]] = {}  # argument field -> the word that holds it
    PACKED: ClassVar[dict[str, tuple[Word, int]]] = {}  # field -> (the word whose high bits hold it, its bias)
    wait: int = NO_COUNTER
    wait_count: int = 0
    signal: int = NO_COUNTER
    flags: int = 0  # CLUSTER_PAIR, EXPERT_SPAN, PEER (the hold marks are or'ed into the encoded words only)
    tiles: TileSpan = TileSpan()
    ticket: int = NO_COUNTER  # the ticket counter of a result in parts (ops that have one encode it)

    @property
    def has_finisher(self) -> bool:
        """Whether a part of this instruction (the last to draw its ticket, or part 0 of a cluster pair) finishes
        the result (the op module's ``finish``)."""
        return False

    @property
    def ticket_count(self) -> int:
        """Parts that draw the ticket per step (1 when there is none)."""
        return 1

    def mate_key(self) -> tuple:
        """What the two parts of a cluster pair share (op, layer and the unit they split); they differ in part."""
        raise ValueError(f"{self} does not run in cluster pairs")

    def encode(self) -> list[int]:
        w = [0] * NWORDS
        w[Word.OP] = int(self.OP)
        w[Word.WAIT], w[Word.WAIT_COUNT], w[Word.SIGNAL] = self.wait, self.wait_count, self.signal
        w[Word.FLAGS] = self.flags
        t = self.tiles
        w[Word.T0], w[Word.NR], w[Word.K0], w[Word.K1], w[Word.KT] = t.t0, t.nr, t.k0, t.k1, t.kt
        for name, word in self.FIELDS.items():
            w[word] = int(getattr(self, name))
        for name, (word, bias) in self.PACKED.items():
            v = int(getattr(self, name)) - bias
            if not 0 <= v < 1 << (31 - PACK_SHIFT) or not 0 <= w[word] < 1 << PACK_SHIFT:
                raise ValueError(f"{self}: {name} does not pack above bit {PACK_SHIFT} of word {word.name}")
            w[word] |= v << PACK_SHIFT
        if bool(t.xs) != bool(self.flags & EXPERT_SPAN) or (t.xs and XS_WORD in self.FIELDS.values()):
            raise ValueError(f"{self}: an expert span (xs > 0) goes with EXPERT_SPAN and a free Word.E")
        if t.xs:
            w[XS_WORD] = t.xs
        return w


@dataclass(frozen=True)
class RowBlock(Instruction):
    """A matvec instruction over rows [row0, row0 + nrows) of one weight matrix, for every token of the step."""

    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "row0": Word.A, "nrows": Word.B}
    layer: int = 0
    row0: int = 0
    nrows: int = 0


@dataclass(frozen=True)
class Nop(Instruction):
    OP: ClassVar[Op] = Op.NOP


def decode(words, table: dict[Op, type[Instruction]]) -> Instruction:
    """Inverse of ``Instruction.encode`` (words: any int sequence of length NWORDS; ``table``: the instruction
    class of each opcode, ``ops.CLASSES``)."""
    w = [int(x) for x in words]
    if len(w) != NWORDS:
        raise ValueError(f"an instruction has {NWORDS} words, got {len(w)}")
    try:
        cls = table[Op(w[Word.OP])]
    except ValueError:
        raise ValueError(f"unknown opcode {w[Word.OP]}") from None
    expert = w[Word.FLAGS] & EXPERT_SPAN
    common = dict(wait=w[Word.WAIT], wait_count=w[Word.WAIT_COUNT], signal=w[Word.SIGNAL],
                  flags=w[Word.FLAGS] & (CLUSTER_PAIR | EXPERT_SPAN | PEER),
                  tiles=TileSpan(w[Word.T0], w[Word.NR], w[Word.K0], w[Word.K1], w[Word.KT],
                                 w[XS_WORD] if expert else 0))
    packed = {name: (w[word] >> PACK_SHIFT) + bias for name, (word, bias) in cls.PACKED.items()}
    for word, _ in cls.PACKED.values():
        w[word] &= (1 << PACK_SHIFT) - 1
    return cls(**{name: w[word] for name, word in cls.FIELDS.items()}, **packed, **common)


def kernel_constants() -> dict[str, int]:
    """Constexpr values the Gluon kernel takes from this module: OP_<NAME>, W_<FIELD>, NWORDS and the flags."""
    out = {f"OP_{o.name}": int(o) for o in Op}
    out.update({f"W_{w.name}": int(w) for w in Word})
    out.update(NWORDS=NWORDS, CLUSTER_PAIR=CLUSTER_PAIR, HOLD_ARRIVE=HOLD_ARRIVE, HOLD_WAIT=HOLD_WAIT,
               EXPERT_SPAN=EXPERT_SPAN, PEER=PEER, XS_WORD=int(XS_WORD), SLOT_WORD=int(SLOT_WORD),
               ROUTE_BITS=ROUTE_BITS, PACK_SHIFT=PACK_SHIFT, NO_EXPERT=NO_EXPERT, ROUTE_TAG_MASK=_TAG_MASK,
               ROUTE_TAG_SET=_TAG_SET)
    return out
