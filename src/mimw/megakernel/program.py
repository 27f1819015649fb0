"""The scheduler: ModelSpec + step shape + SM count -> per-SM instruction queues and a counter table.

Plan once per (model, step shape, SM count); the hot path only fills the step state (tokens, positions, block
tables, context lengths) and launches. Context length is read at run time, so one program serves every context:
each attention split covers ``ceil(ctx / n_splits)`` positions of its segment, empty splits included.

Queues are filled stage by stage (ATTN_IN, ATTN_PARTIAL, [ATTN_REDUCE unless the splits combine themselves],
O_PROJ, MLP_IN, DOWN_PROJ per layer, then LM_HEAD), so every instruction appears after all instructions of earlier
stages in its own queue. Instructions only wait on counters signalled by (or, with versioned words, on data written
by) earlier stages, hence no cycle of waits can form: with every CTA resident (one
persistent CTA per SM), the program always completes. Within a stage, instructions go to SMs by
longest-processing-time-first on a byte-based cost model, ties broken by each SM's total load so the small stages
land on different SMs and the whole step finishes together.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

import torch

from ..models.spec import ModelSpec
from . import isa
from .isa import AttnIn, AttnPartial, AttnReduce, DownProj, Instruction, LmHead, MlpIn, OProj


@dataclass(frozen=True)
class StepShape:
    """Tokens per segment in one step: (1,)*M for a decode batch of M sequences, (M,) for one verify block."""

    seg_lens: tuple[int, ...] = (1,)
    context_hint: int = 1024  # typical context, only used to size attention splits

    def __post_init__(self):
        if not self.seg_lens or any(n <= 0 for n in self.seg_lens):
            raise ValueError(f"seg_lens must be non-empty positive lengths, got {self.seg_lens}")

    @property
    def num_tokens(self) -> int:
        return sum(self.seg_lens)

    @property
    def seg_starts(self) -> tuple[int, ...]:
        out, t = [], 0
        for n in self.seg_lens:
            out.append(t)
            t += n
        return tuple(out)


@dataclass(frozen=True)
class ProgramConfig:
    tile_rows: int = 16  # rows per weight tile: every matvec row block is a multiple of it
    tile_k: int = 256  # columns per weight tile: ATTN_IN column parts are whole column tiles
    qkv_parts: int = 0  # column parts per ATTN_IN head (0: chosen by the cost model, qkv_parts())
    max_block_bytes: int = 256 * 1024  # cap on one matvec instruction's weight bytes
    min_split_tokens: int = 32  # attention splits get at least this many positions (at context_hint)
    fixed_cost_bytes: int = 16 * 1024  # per-instruction overhead in the cost model (a counter hop ~ 0.6 us)
    ticket_cost_bytes: int = 64 * 1024  # extra per ticketed part: acq_rel ticket + the finisher's reads (~2 us, H200)
    combine_splits: bool = True  # ATTN_PARTIAL splits combine themselves (ticket) instead of an ATTN_REDUCE stage
    flag_act: bool = False  # MLP_IN -> DOWN_PROJ through versioned act words (isa.READS_ACT) instead of a counter:
    # MLP_IN blocks signal nothing; DOWN_PROJ waits on the versions of the act words (and, unless x is versioned
    # too, on the O_PROJ counter MLP_IN already waited on, which orders its reads of the x rows)
    flag_x: bool = False  # the residual stream x as versioned words (isa.READS_X): O_PROJ and DOWN_PROJ store their
    # rows versioned and signal nothing; ATTN_IN, MLP_IN, LM_HEAD and the residual reads wait on x's versions
    flag_q: bool = False  # the query heads and the new K/V row as versioned words (isa.READS_Q): ATTN_IN's
    # finishers signal nothing, ATTN_PARTIAL waits on no counter (the row still goes to the paged cache too)
    flag_attn: bool = False  # the attention output as versioned words (isa.READS_ATTN; needs flag_x, which orders
    # O_PROJ's residual reads): the combining split (or ATTN_REDUCE) signals nothing, O_PROJ waits on no counter
    merge_signals: bool = False  # consecutive instructions of one SM's queue that signal the same counter and have
    # no finisher release once, at the run's end, by the run's length (isa.Word.SIGNAL_N): their readers wait for
    # the whole stage anyway, so the earlier releases (a loaded round trip each) bought nothing
    qkv_in_attn: bool = False  # ATTN_IN's heads finished by the ATTN_PARTIALs that read them (isa.QKV_IN_ATTN):
    # no tickets in ATTN_IN, its parts signal the group's counter directly; not with flag_q (no finished q words)
    o_parts: int = 0  # O_PROJ split over its columns into this many parts of Hkv / o_parts KV groups each (0: one
    # O_PROJ stage over the combined attention output): the attention splits neither combine nor draw tickets,
    # they signal their part's counter; each O_PROJ instruction (part, row block) combines its groups' partials
    # itself and stores x_part[part, rows], part 0 with the residual; MLP_IN and DOWN_PROJ sum the parts (isa.py)
    signal_logits: bool = True  # LM_HEAD blocks signal a counter; no instruction waits on it (the launch's end
    # publishes the logits), so False spares each block the release (its barrier and fenced atomic)
    cluster_qkv: bool = False  # ATTN_IN's two column parts of every head on the two CTAs of a thread-block cluster
    # (SMs 2c, 2c + 1; isa.CLUSTER_PAIR): the parts swap sums through distributed shared memory instead of a ticket
    # and a global round trip; needs two parts (qkv_parts 0 or 2), an even SM count, and no qkv_in_attn
    cluster_down: bool = False  # DOWN_PROJ's two column halves of a row block on the two CTAs of a cluster
    # (isa.CLUSTER_PAIR, as ATTN_IN's heads with cluster_qkv, which it needs), where the row blocks are at most
    # half the SMs (the 1B: 64 for 132): twice the SMs work on the stage; part 0 adds part 1's sums (shared memory)
    # and the residual and signals. Not with versioned x or act, O_PROJ parts or merged releases
    sm_bytes_per_us: float = 34e3  # HBM bandwidth / SM count, for cost-model reports

    def check(self) -> None:
        """Raise ValueError for option combinations no program can have (``build_program`` and
        ``KernelConfig.check`` both run it)."""
        if self.flag_attn and not self.flag_x:
            raise ValueError("flag_attn needs flag_x: without a counter, O_PROJ's reads of x must be versioned too")
        if self.qkv_in_attn and self.flag_q:
            raise ValueError("qkv_in_attn and flag_q exclude each other: with qkv_in_attn no finisher writes q words")
        if self.o_parts < 0:
            raise ValueError(f"o_parts={self.o_parts}: 0 (one O_PROJ stage) or a positive number of column parts")
        if self.cluster_qkv and self.qkv_parts not in (0, 2):
            raise ValueError(f"cluster_qkv pairs two column parts a head, not qkv_parts={self.qkv_parts}")
        if self.cluster_qkv and self.qkv_in_attn:
            raise ValueError("cluster_qkv and qkv_in_attn exclude each other: with qkv_in_attn ATTN_IN has no finisher")
        if self.cluster_down and not self.cluster_qkv:
            raise ValueError("cluster_down needs cluster_qkv: the kernel runs in clusters only with ATTN_IN's pairs")
        if self.cluster_down and (self.flag_x or self.flag_act or self.o_parts or self.merge_signals):
            raise ValueError("cluster_down excludes flag_x, flag_act, o_parts and merge_signals")
        if self.o_parts and (self.flag_x or self.flag_attn):
            raise ValueError("o_parts excludes flag_x and flag_attn: its x parts and partials are not versioned "
                             "words")

    def check_spec(self, spec: ModelSpec) -> None:
        """Raise ValueError where this config cannot serve ``spec``: o_parts must divide the KV heads, and each
        part's columns (its groups' query heads) must be whole column tiles."""
        if self.o_parts:
            hkv, cols = spec.num_kv_heads, spec.q_size
            if hkv % self.o_parts:
                raise ValueError(f"o_parts={self.o_parts} must divide the {hkv} KV heads")
            if (cols // self.o_parts) % self.tile_k:
                raise ValueError(f"o_parts={self.o_parts}: a part's {cols // self.o_parts} columns are not whole "
                                 f"{self.tile_k}-column tiles")


@dataclass(frozen=True)
class Counter:
    name: str
    count: int  # signals per step


@dataclass
class Program:
    spec: ModelSpec
    shape: StepShape
    num_sms: int
    config: ProgramConfig
    queues: list[list[Instruction]]
    counters: list[Counter]
    n_splits: tuple[int, ...]  # attention splits per segment
    qkv_parts: int  # column parts of every ATTN_IN head
    costs: list[float] = field(default_factory=list)  # per-SM cost-model load, in bytes

    @property
    def max_splits(self) -> int:
        return max(self.n_splits)

    def instructions(self):
        for q in self.queues:
            yield from q

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(words [num_sms, max_len, NWORDS] int32 padded with NOP, lengths [num_sms] int32)."""
        n = max(1, max(len(q) for q in self.queues))
        nop = isa.Nop().encode()
        rows = [[ins.encode() for ins in q] + [nop] * (n - len(q)) for q in self.queues]
        return torch.tensor(rows, dtype=torch.int32), torch.tensor([len(q) for q in self.queues], dtype=torch.int32)

    def validate(self) -> None:
        """Every counter is signalled exactly ``count`` times per step, and waits name existing counters with their
        count (so step-numbered targets stay correct across steps without a reset)."""
        sig = [0] * len(self.counters)
        ticketed: dict[int, set[int]] = {}  # ticket counter -> signal counters of its parts
        for ins in self.instructions():
            ticket = getattr(ins, "ticket", isa.NO_COUNTER)
            if ticket != isa.NO_COUNTER:  # every part draws a ticket; only the last one signals
                sig[ticket] += 1
                if not ins.has_finisher or ins.ticket_count != self.counters[ticket].count:
                    raise AssertionError(f"{ins} draws {ins.ticket_count} tickets (finisher: {ins.has_finisher}), "
                                         f"ticket {self.counters[ticket]}")
                ticketed.setdefault(ticket, set()).add(ins.signal)
            elif ins.signal != isa.NO_COUNTER:
                sig[ins.signal] += ins.signal_n
            if ins.wait != isa.NO_COUNTER and ins.wait_count != self.counters[ins.wait].count:
                raise AssertionError(f"{ins} waits for {ins.wait_count}, counter has {self.counters[ins.wait]}")
        for ticket, signals in ticketed.items():
            if len(signals) != 1:
                raise AssertionError(f"parts of ticket {self.counters[ticket]} signal different counters {signals}")
            if (c := signals.pop()) != isa.NO_COUNTER:
                sig[c] += 1
        for c, n in zip(self.counters, sig):
            if n != c.count:
                raise AssertionError(f"counter {c.name} is signalled {n} times per step, expected {c.count}")
        if errors := cluster_mate_errors(self.queues):
            raise AssertionError("; ".join(errors[:4]))


def row_blocks(rows: int, row_bytes: int, num_sms: int, cfg: ProgramConfig,
               granule: int | None = None) -> list[tuple[int, int]]:
    """Split ``rows`` into blocks of whole granules (default: tile_rows), choosing the block size that minimises the
    stage's makespan over ``num_sms`` in the cost model (weight bytes plus the fixed per-instruction cost), capped
    by ``max_block_bytes``; ties go to larger blocks."""
    tr = granule or cfg.tile_rows
    if rows % tr:
        raise ValueError(f"{rows} rows are not a multiple of the {tr}-row granule")
    tiles = rows // tr
    cap = max(1, min(tiles, cfg.max_block_bytes // (tr * row_bytes)))
    tile_bytes = tr * row_bytes

    def makespan(p: int) -> int:  # the busiest SM's cost for this stage, per-instruction overhead included
        return math.ceil(math.ceil(tiles / p) / num_sms) * (p * tile_bytes + cfg.fixed_cost_bytes)

    best = min(range(1, cap + 1), key=lambda p: (makespan(p), -p))
    out, r = [], 0
    while r < rows:
        n = min(best * tr, rows - r)
        out.append((r, n))
        r += n
    return out


def column_part(k: int, tile_k: int, part: int, n_parts: int) -> tuple[int, int]:
    """Columns [c0, c1) of part ``part`` of ``n_parts`` over k columns: whole tiles of ``tile_k``, as even as can be."""
    kt = -(-k // tile_k)
    t0, t1 = part * kt // n_parts, (part + 1) * kt // n_parts
    return min(k, t0 * tile_k), min(k, t1 * tile_k)


def qkv_parts(spec: ModelSpec, num_sms: int, cfg: ProgramConfig) -> int:
    """Column parts per ATTN_IN head: a layer has only Hq + 2*Hkv heads (48 for Llama 1B/8B), too few to keep 132 SMs
    streaming, so each head is split over its columns. The count minimises the stage's makespan in the cost model
    (each part pays the fixed cost and, when split, the ticket cost; at most 8 parts, never more than the column
    tiles); within 5% of the best, fewer parts win (each part costs ~2 us of fixed latency the model only
    approximates)."""
    if cfg.qkv_parts or cfg.cluster_qkv:
        return cfg.qkv_parts or 2
    heads, kt = spec.num_heads + 2 * spec.num_kv_heads, -(-spec.hidden_size // cfg.tile_k)
    head_bytes = spec.head_dim * spec.hidden_size * 2

    def makespan(n: int) -> float:
        ticket = cfg.ticket_cost_bytes if n > 1 and not cfg.qkv_in_attn else 0  # qkv_in_attn: parts, no ticket
        per_part = head_bytes / n + cfg.fixed_cost_bytes + ticket
        return math.ceil(heads * n / num_sms) * per_part

    options = range(1, min(8, kt) + 1)
    best = min(makespan(n) for n in options)
    return min(n for n in options if makespan(n) <= 1.05 * best)


def attention_splits(spec: ModelSpec, shape: StepShape, num_sms: int, cfg: ProgramConfig) -> tuple[int, ...]:
    per_seg = max(1, num_sms // (spec.num_kv_heads * len(shape.seg_lens)))
    by_len = max(1, math.ceil(shape.context_hint / cfg.min_split_tokens))
    return tuple(min(per_seg, by_len) for _ in shape.seg_lens)


def cost(spec: ModelSpec, shape: StepShape, ins: Instruction, cfg: ProgramConfig) -> float:
    """Bytes-equivalent cost of one instruction: weight/KV bytes it streams plus a fixed overhead."""
    d, hd = spec.hidden_size, spec.head_dim
    if isinstance(ins, AttnIn):
        c0, c1 = column_part(d, cfg.tile_k, ins.part, ins.n_parts)
        b = hd * (c1 - c0) * 2
    elif isinstance(ins, AttnPartial):
        ctx = shape.context_hint + shape.seg_lens[ins.seg]
        b = math.ceil(ctx / ins.n_splits) * hd * 2 * 2
        if ins.ticket != isa.NO_COUNTER:  # the ticket, and (for one split in n) the combine
            b += cfg.ticket_cost_bytes
    elif isinstance(ins, AttnReduce):
        b = ins.n_splits * spec.group_size * hd * 4 * shape.seg_lens[ins.seg]
    elif isinstance(ins, OProj):
        b = ins.nrows * spec.q_size // max(1, ins.n_parts) * 2
    elif isinstance(ins, MlpIn):
        b = 2 * ins.nrows * d * 2
    elif isinstance(ins, DownProj):
        b = ins.nrows * spec.intermediate_size // max(1, ins.n_parts) * 2
    elif isinstance(ins, LmHead):
        b = ins.nrows * d * 2
    else:
        b = 0
    return b + cfg.fixed_cost_bytes


def build_program(spec: ModelSpec, shape: StepShape, num_sms: int, cfg: ProgramConfig = ProgramConfig()) -> Program:
    if num_sms <= 0:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    cfg.check()
    cfg.check_spec(spec)
    counters: list[Counter] = []

    def counter(name: str, count: int) -> int:
        counters.append(Counter(name, count))
        return len(counters) - 1

    L, hq, hkv, g = spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.group_size
    n_splits = attention_splits(spec, shape, num_sms, cfg)
    n_parts = qkv_parts(spec, num_sms, cfg)
    if not 1 <= n_parts <= -(-spec.hidden_size // cfg.tile_k):
        raise ValueError(f"qkv_parts={n_parts} must be between 1 and the {spec.hidden_size}-column row's tile count")
    segs = range(len(shape.seg_lens))
    op = cfg.o_parts  # O_PROJ column parts (0: none)
    o_blocks = row_blocks(spec.hidden_size, spec.q_size // max(1, op) * 2, -(-num_sms // max(1, op)), cfg)
    # MLP_IN: a weight tile holds tile_rows/2 gate and tile_rows/2 up rows (gpu/pack.py), so blocks of outputs
    # come in tile_rows/2 steps (896 blocks instead of 448 for the 8B's 132 SMs: a 3% makespan excess, not 18%)
    mlp_blocks = row_blocks(spec.intermediate_size, 2 * spec.hidden_size * 2, num_sms, cfg, cfg.tile_rows // 2)
    down_blocks = row_blocks(spec.hidden_size, spec.intermediate_size * 2, num_sms, cfg)
    lm_blocks = row_blocks(spec.vocab_size, spec.hidden_size * 2, num_sms, cfg)

    # DOWN_PROJ's row blocks in column halves on cluster mates, where they leave half the SMs idle or more
    pair_down = cfg.cluster_down and 2 * len(down_blocks) <= num_sms and -(-spec.intermediate_size // cfg.tile_k) > 1
    stages: list[list[Instruction]] = []
    if cfg.cluster_qkv and num_sms % 2:
        raise ValueError(f"cluster_qkv places pairs on clusters of two SMs: {num_sms} SMs is odd")
    prev, prev_n = isa.NO_COUNTER, 0  # counter that marks the residual stream x complete for this layer
    vx = isa.READS_X if cfg.flag_x else 0
    va = isa.WRITES_VERSIONED if cfg.flag_attn else 0
    vq = isa.WRITES_VERSIONED if cfg.flag_q else 0
    late = isa.QKV_IN_ATTN if cfg.qkv_in_attn else 0
    for l in range(L):
        # ATTN_PARTIAL of KV group k waits for its G q heads and its K and V heads: their finishers, or (qkv_in_attn)
        # every column part of them
        qkv_n = 0 if cfg.flag_q else (g + 2) * (n_parts if late else 1)
        qkv = [isa.NO_COUNTER if cfg.flag_q else counter(f"L{l}.qkv.kv{k}", qkv_n) for k in range(hkv)]

        def group(h: int) -> int:  # which KV group a q/k/v head feeds
            return h // g if h < hq else (h - hq) % hkv

        ticketed = n_parts > 1 and not late and not cfg.cluster_qkv
        tickets = [counter(f"L{l}.qkv_ticket.h{h}", n_parts) if ticketed else isa.NO_COUNTER
                   for h in range(hq + 2 * hkv)]
        pair = isa.CLUSTER_PAIR if cfg.cluster_qkv else 0  # part 1 of a pair hands its sums to part 0: no signal
        stages.append([AttnIn(layer=l, head=h, part=p, n_parts=n_parts, ticket=tickets[h], wait=prev,
                              wait_count=prev_n, signal=isa.NO_COUNTER if pair and p else qkv[group(h)],
                              flags=(vx if l > 0 else 0) | vq | late | pair)
                       for h in range(hq + 2 * hkv) for p in range(n_parts)])
        fin = n_parts if late else 0  # the parts an ATTN_PARTIAL sums when it finishes its heads
        pq = (isa.READS_Q if cfg.flag_q else 0) | late
        if op:  # every split signals its O_PROJ part's counter; each O_PROJ instruction combines its groups
            gpp = hkv // op  # KV groups per part
            if len(set(n_splits)) != 1:  # an O_PROJ block carries one split count for every segment (isa.Word.E)
                raise ValueError(f"o_parts needs the same attention splits in every segment, got {n_splits}")
            opart = [counter(f"L{l}.attn.part{p}", gpp * sum(n_splits)) for p in range(op)]
            stages.append([AttnPartial(layer=l, kv_head=k, seg=s, split=i, n_splits=n_splits[s], n_parts=fin,
                                       wait=qkv[k], wait_count=qkv_n, signal=opart[k // gpp], flags=pq)
                           for k in range(hkv) for s in segs for i in range(n_splits[s])])
            o = counter(f"L{l}.o_proj", op * len(o_blocks))
            stages.append([OProj(layer=l, row0=r, nrows=n, part=p, n_parts=op, n_splits=n_splits[0], wait=opart[p],
                                 wait_count=gpp * sum(n_splits), signal=o)
                           for p in range(op) for r, n in o_blocks])
            o_n = op * len(o_blocks)
        else:
            red = isa.NO_COUNTER if cfg.flag_attn else counter(f"L{l}.attn_out", hkv * len(segs))
            if cfg.combine_splits:  # the last split of each (kv head, segment) combines: one hop fewer
                tick = {(k, s): counter(f"L{l}.attn_ticket.kv{k}.seg{s}", n_splits[s]) if n_splits[s] > 1
                        else isa.NO_COUNTER for k in range(hkv) for s in segs}
                stages.append([AttnPartial(layer=l, kv_head=k, seg=s, split=i, n_splits=n_splits[s],
                                           ticket=tick[k, s], combine=1, n_parts=fin, wait=qkv[k], wait_count=qkv_n,
                                           signal=red, flags=va | pq)
                               for k in range(hkv) for s in segs for i in range(n_splits[s])])
            else:
                part = {(k, s): counter(f"L{l}.attn.kv{k}.seg{s}", n_splits[s]) for k in range(hkv) for s in segs}
                stages.append([AttnPartial(layer=l, kv_head=k, seg=s, split=i, n_splits=n_splits[s], n_parts=fin,
                                           wait=qkv[k], wait_count=qkv_n, signal=part[k, s], flags=pq)
                               for k in range(hkv) for s in segs for i in range(n_splits[s])])
                stages.append([AttnReduce(layer=l, kv_head=k, seg=s, n_splits=n_splits[s], wait=part[k, s],
                                          wait_count=n_splits[s], signal=red, flags=va)
                               for k in range(hkv) for s in segs])
            # x rows: versioned words (no counter), or a counter per stage
            o = isa.NO_COUNTER if cfg.flag_x else counter(f"L{l}.o_proj", len(o_blocks))
            o_flags = ((isa.WRITES_VERSIONED | (vx if l > 0 else 0)) if cfg.flag_x else 0) | \
                (isa.READS_ATTN if cfg.flag_attn else 0)
            stages.append([OProj(layer=l, row0=r, nrows=n, wait=red,
                                 wait_count=0 if cfg.flag_attn else hkv * len(segs), signal=o, flags=o_flags)
                           for r, n in o_blocks])
            o_n = 0 if cfg.flag_x else len(o_blocks)
        if cfg.flag_act:  # the act words carry their version: DOWN_PROJ waits on them, not on a counter
            stages.append([MlpIn(layer=l, row0=r, nrows=n, wait=o, wait_count=o_n,
                                 flags=vx | isa.WRITES_VERSIONED) for r, n in mlp_blocks])
            # without versioned x, the O_PROJ counter (met before any MLP_IN ran) orders DOWN_PROJ's reads of x
            down_wait, down_n, down_flags = o, o_n, isa.READS_ACT
        else:
            mlp = counter(f"L{l}.mlp_in", len(mlp_blocks))
            stages.append([MlpIn(layer=l, row0=r, nrows=n, wait=o, wait_count=o_n, signal=mlp, flags=vx)
                           for r, n in mlp_blocks])
            down_wait, down_n, down_flags = mlp, len(mlp_blocks), 0
        down = isa.NO_COUNTER if cfg.flag_x else counter(f"L{l}.down_proj", len(down_blocks))
        if pair_down:  # column halves on cluster mates: part 0 finishes the rows and alone signals
            stages.append([DownProj(layer=l, row0=r, nrows=n, part=p, n_parts=2, wait=down_wait, wait_count=down_n,
                                    signal=isa.NO_COUNTER if p else down, flags=down_flags | isa.CLUSTER_PAIR)
                           for r, n in down_blocks for p in range(2)])
        else:
            stages.append([DownProj(layer=l, row0=r, nrows=n, wait=down_wait, wait_count=down_n, signal=down,
                                    flags=down_flags | ((vx | isa.WRITES_VERSIONED) if cfg.flag_x else 0))
                           for r, n in down_blocks])
        prev, prev_n = down, 0 if cfg.flag_x else len(down_blocks)
    lm = counter("lm_head", len(lm_blocks)) if cfg.signal_logits else isa.NO_COUNTER
    stages.append([LmHead(layer=0, row0=r, nrows=n, wait=prev, wait_count=prev_n, signal=lm, flags=vx)
                   for r, n in lm_blocks])

    queues: list[list[Instruction]] = [[] for _ in range(num_sms)]
    total = [0.0] * num_sms
    for stage in stages:
        if stage and stage[0].flags & isa.CLUSTER_PAIR:  # cluster_qkv / cluster_down: pairs go to cluster mates
            place_pairs(spec, shape, cfg, stage, queues, total)
            continue
        heap = [(0.0, total[s], s) for s in range(num_sms)]
        heapq.heapify(heap)
        costed = sorted(((cost(spec, shape, i, cfg), k, i) for k, i in enumerate(stage)), key=lambda t: (-t[0], t[1]))
        for c, _, ins in costed:
            load, tot, s = heapq.heappop(heap)
            queues[s].append(ins)
            total[s] += c
            heapq.heappush(heap, (load + c, tot + c, s))
    if cfg.merge_signals:
        queues = [merge_signals(q) for q in queues]
    prog = Program(spec, shape, num_sms, cfg, queues, counters, n_splits, n_parts, total)
    prog.validate()
    return prog


def place_pairs(spec: ModelSpec, shape: StepShape, cfg: ProgramConfig, stage: list[Instruction],
                queues: list[list[Instruction]], total: list[float]) -> None:
    """Place a stage of cluster pairs (isa.CLUSTER_PAIR, parts 0 and 1 of each head or row block, in that order):
    each pair to the cluster (SMs 2c, 2c + 1) with the least load in this stage, ties to the least total load,
    longest-processing-time first as in ``build_program``; part 0 on 2c, part 1 on 2c + 1. Both SMs of a cluster
    get the same pairs in the same order, so the k-th pair instruction of one queue meets the k-th of its mate's."""
    heap = [(0.0, total[2 * c] + total[2 * c + 1], c) for c in range(len(queues) // 2)]
    heapq.heapify(heap)
    heads = [(stage[j], stage[j + 1]) for j in range(0, len(stage), 2)]
    costed = sorted(((max(cost(spec, shape, a, cfg), cost(spec, shape, b, cfg)), k, a, b)
                     for k, (a, b) in enumerate(heads)), key=lambda t: (-t[0], t[1]))
    for c_, _, a, b in costed:
        load, tot, c = heapq.heappop(heap)
        queues[2 * c].append(a)
        queues[2 * c + 1].append(b)
        total[2 * c] += c_
        total[2 * c + 1] += c_
        heapq.heappush(heap, (load + c_, tot + 2 * c_, c))


def cluster_mate_errors(queues: list[list[Instruction]]) -> list[str]:
    """Why the cluster pairs of ``queues`` cannot meet (empty: they can): the k-th CLUSTER_PAIR instruction of SM
    2c must be part 0 and the k-th of SM 2c + 1 part 1 of the same pair (``mate_key``: ATTN_IN's head, DOWN_PROJ's
    row block), both queues holding equally many."""
    out = []
    pairs = [[ins for ins in q if ins.flags & isa.CLUSTER_PAIR] for q in queues]
    if any(pairs) and len(queues) % 2:
        return [f"{len(queues)} SMs do not form clusters of two"]
    for c in range(len(queues) // 2):
        a, b = pairs[2 * c], pairs[2 * c + 1]
        if len(a) != len(b):
            out.append(f"SMs {2 * c}, {2 * c + 1} hold {len(a)} and {len(b)} cluster-pair instructions")
        for x, y in zip(a, b):
            if x.mate_key() != y.mate_key() or (x.part, y.part, x.n_parts) != (0, 1, 2):
                out.append(f"SMs {2 * c}, {2 * c + 1}: {x} does not pair with {y}")
    return out


def merge_signals(queue: list[Instruction]) -> list[Instruction]:
    """One release per run of consecutive instructions that signal the same counter and have no finisher: the last
    adds the run's length (``signal_n``), the others add nothing. Their readers wait for the counter's whole count,
    so no reader could have started earlier; the run's last release orders every store of the run (the partition
    barrier before it covers all of them)."""
    out: list[Instruction] = []
    for ins in queue:
        prev = out[-1] if out else None
        if (prev is not None and ins.signal != isa.NO_COUNTER and prev.signal == ins.signal
                and not prev.has_finisher and not ins.has_finisher):
            out[-1] = dataclasses.replace(prev, signal_n=0)
            ins = dataclasses.replace(ins, signal_n=prev.signal_n + 1)
        out.append(ins)
    return out
