"""The scheduler: ModelSpec + step shape + SM count -> per-SM instruction queues and a counter table.

Plan once per (model, step shape, SM count); the hot path only fills the step state (tokens, positions, block
tables, context lengths) and launches. Context length is read at run time, so one program serves every context:
each attention split covers its share of the segment's context, empty splits included.

Queues are filled stage by stage (ATTN_IN, ATTN_PARTIAL, O_PROJ, MLP_IN, DOWN_PROJ per layer, or ROUTER, EXPERT_IN,
EXPERT_DOWN in place of the MLP stages on an MoE layer, then LM_HEAD; with tensor parallelism a REDUCE stage
after each of O_PROJ, DOWN_PROJ and LM_HEAD), so
every instruction appears after all instructions of earlier stages in its own queue. Instructions only wait on
counters signalled by earlier stages, hence no cycle of waits can form: with every CTA resident (one persistent CTA
per SM), the program always completes. Within a stage, instructions go to SMs by longest-processing-time-first on a
byte-based cost model (the weight tiles each streams, ``isa.TileSpan``, its K/V bytes, plus a fixed cost), ties
broken by each SM's total load so the small stages land on different SMs and the whole step finishes together.

Cluster pairs (isa.CLUSTER_PAIR) where ``ProgramConfig.clusters`` allows them and the shape can form them (an even
SM count, at least two column tiles to split): ATTN_IN's heads always run as two column parts on the CTAs of one
cluster, and DOWN_PROJ's row blocks as two column halves where they would leave half the SMs idle or more.

MoE layers (``moe_stages``): which experts run is known only at run time, so the program has S = min(E, M * k)
routing slots per layer (``moe_slots``: k for one token) and runs every slot's row blocks; the router's finisher
puts the step's distinct experts in the first slots, ascending, and the others idle (isa.NO_EXPERT). A slot's
EXPERT_DOWN needs only its own slot's EXPERT_IN (one counter per slot), and the slots of a row block join behind a
ticket whose last drawer adds them to the residual in slot order.

Tensor parallelism (``ProgramConfig.tp`` = (rank, size), size > 1; docs/megakernel.md): the program is built for the
rank's shard (tensor_parallel.shard_spec), whose O_PROJ, DOWN_PROJ and LM_HEAD row blocks are flagged isa.PEER and
signal peer counters (``Counter.peer``: one per row block, N signals a step, one from each rank); a REDUCE stage
of the same row blocks follows each, waiting on those counters; the O_PROJ and DOWN_PROJ reductions signal a local
counter that the next stage waits on, as the projections themselves do on one GPU. Every rank's words are the same.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from ..models.spec import ModelSpec
from . import isa
from .isa import Instruction
from .ops.attn_in import AttnIn
from .ops.attn_in import span as attn_in_span
from .ops.attn_partial import AttnPartial, kv_bytes
from .ops.down_proj import DownProj
from .ops.down_proj import span as down_span
from .ops.expert_down import ExpertDown
from .ops.expert_down import span as expert_down_span
from .ops.expert_in import ExpertIn
from .ops.expert_in import span as expert_in_span
from .ops.lm_head import LmHead
from .ops.lm_head import span as lm_span
from .ops.mlp_in import MlpIn
from .ops.mlp_in import span as mlp_span
from .ops.o_proj import OProj
from .ops.o_proj import span as o_span
from .ops.reduce import Reduce
from .ops.router import Router
from .ops.router import span as router_span
from .peers import DOWN_SUM, LM_GATHER, O_SUM
from .tensor_parallel import TensorParallel, shard_spec
from .tiles import WeightTiles, router_rows


@dataclass(frozen=True)
class StepShape:
    """Tokens per segment in one step: (1,)*M for a decode batch of M sequences, (M,) for one verify block.

    ``attn_blocks``: where every segment is one token (the GPU kernel's multi-token steps, launch/one_token.py),
    the lengths of the runs of consecutive segments that attention runs as one query block, in segment order: a
    verify block's tokens (one sequence, consecutive positions; the host fills them so) whose attention reads each
    K/V block once for all of them (ops/attn_partial.py). () : every segment its own query block."""

    seg_lens: tuple[int, ...] = (1,)
    context_hint: int = 1024  # typical context, only used to size attention splits
    attn_blocks: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.seg_lens or any(n <= 0 for n in self.seg_lens):
            raise ValueError(f"seg_lens must be non-empty positive lengths, got {self.seg_lens}")
        if self.attn_blocks and (any(n != 1 for n in self.seg_lens) or any(n <= 0 for n in self.attn_blocks)
                                 or sum(self.attn_blocks) != len(self.seg_lens)):
            raise ValueError(f"attn_blocks {self.attn_blocks} must be positive runs covering the "
                             f"{len(self.seg_lens)} segments, every one a single token")

    @property
    def attn_groups(self) -> tuple[tuple[int, int], ...]:
        """(first segment, segments) of every attention query block, in segment order."""
        if not self.attn_blocks:
            return tuple((s, 1) for s in range(len(self.seg_lens)))
        out, s = [], 0
        for n in self.attn_blocks:
            out.append((s, n))
            s += n
        return tuple(out)

    def query_tokens(self, seg: int, segs: int = 1) -> slice:
        """The step's tokens of segments seg .. seg + segs - 1 (an attention instruction's query rows)."""
        last = seg + segs - 1
        return slice(self.seg_starts[seg], self.seg_starts[last] + self.seg_lens[last])

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
    """The scheduler's choices; the defaults are the ones the GPU kernel ships with (plan.Tuning builds this)."""

    tile_rows: int = 32  # rows per weight tile: every matvec row block is a multiple of it
    tile_k: int = 256  # columns per weight tile: ATTN_IN column parts are whole column tiles
    qkv_parts: int = 0  # column parts per ATTN_IN head (0: chosen by the cost model, qkv_parts(); 2 with clusters)
    max_block_bytes: int = 1024 * 1024  # cap on one matvec instruction's weight bytes
    min_split_tokens: int = 32  # attention splits get at least this many positions (at context_hint)
    min_block_split_tokens: int = 256  # ... and those of a query block of several tokens at least this many: its
    # combine merges every token's partials, so fewer, longer splits pay (bench/NOTES.md, "Query-block splits")
    fixed_cost_bytes: int = 96 * 1024  # per-instruction overhead in the cost model (staging + tail, ~2-5 us)
    ticket_cost_bytes: int = 64 * 1024  # extra per ticketed part: acq_rel ticket + the finisher's reads (~2 us)
    kv_row_bytes: int = 0  # bytes of one cached K (or V) row, scale included (0: bf16, 2 * head_dim)
    clusters: bool = True  # cluster pairs where the shape can form them (see the module doc)
    down_parts: int = 0  # DOWN_PROJ column parts behind a ticket a row block (0 or 1: whole rows); plan.py derives it
    # where a multi-token step's staged activations do not fit in shared memory beside the ring
    max_splits: int = 0  # cap on a segment's attention splits (0: none); plan.py derives it from the GPU combine's
    # registers
    tp: tuple[int, int] = (0, 1)  # tensor parallelism: (this rank, ranks); (0, 1) is one GPU


@dataclass(frozen=True)
class Counter:
    name: str
    count: int  # signals per step
    peer: bool = False  # signalled by every rank's instruction (isa.PEER), the same index in every rank's table


@dataclass
class Program:
    spec: ModelSpec
    shape: StepShape
    num_sms: int
    config: ProgramConfig
    queues: list[list[Instruction]]
    counters: list[Counter]
    n_splits: tuple[int, ...]  # attention splits per attention query block (StepShape.attn_groups)
    qkv_parts: int  # column parts of every ATTN_IN head
    tiles: WeightTiles
    costs: list[float] = field(default_factory=list)  # per-SM cost-model load, in bytes
    moe_slots: int = 0  # routing slots of every MoE layer (0: a dense model)

    @property
    def tp_size(self) -> int:
        """Ranks of tensor parallelism (1: one GPU); ``spec`` is then the rank's shard."""
        return self.config.tp[1]

    @property
    def logits_width(self) -> int:
        """Columns of the step's logits: the whole vocabulary (every rank gathers every shard)."""
        return self.spec.vocab_size * self.tp_size

    @property
    def max_splits(self) -> int:
        return max(self.n_splits)

    @property
    def down_pairs(self) -> bool:
        """Whether DOWN_PROJ runs in cluster pairs (then every one of them does)."""
        return any(isinstance(i, DownProj) and i.flags & isa.CLUSTER_PAIR for i in self.instructions())

    @property
    def down_parts(self) -> int:
        """Column parts of every DOWN_PROJ row block (1: whole rows; 2 in cluster pairs; or ticketed parts)."""
        return max([i.n_parts for i in self.instructions() if isinstance(i, DownProj)] + [1])

    @property
    def attn_pairs(self) -> bool:
        """Whether ATTN_IN runs in cluster pairs (then every head does): the kernel launches in clusters of two."""
        return any(isinstance(i, AttnIn) and i.flags & isa.CLUSTER_PAIR for i in self.instructions())

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
            if ins.ticket != isa.NO_COUNTER:  # every part draws a ticket; only the last one signals
                sig[ins.ticket] += 1
                if not ins.has_finisher or ins.ticket_count != self.counters[ins.ticket].count:
                    raise AssertionError(f"{ins} draws {ins.ticket_count} tickets (finisher: {ins.has_finisher}), "
                                         f"ticket {self.counters[ins.ticket]}")
                ticketed.setdefault(ins.ticket, set()).add(ins.signal)
            elif ins.signal != isa.NO_COUNTER:
                sig[ins.signal] += 1
            if ins.signal != isa.NO_COUNTER and bool(ins.flags & isa.PEER) != self.counters[ins.signal].peer:
                raise AssertionError(f"{ins} signals {self.counters[ins.signal]}: a peer counter goes with isa.PEER")
            if ins.wait != isa.NO_COUNTER and ins.wait_count != self.counters[ins.wait].count:
                raise AssertionError(f"{ins} waits for {ins.wait_count}, counter has {self.counters[ins.wait]}")
        for ticket, signals in ticketed.items():
            if len(signals) != 1:
                raise AssertionError(f"parts of ticket {self.counters[ticket]} signal different counters {signals}")
            if (c := signals.pop()) != isa.NO_COUNTER:
                sig[c] += 1
        for c, n in zip(self.counters, sig):
            n *= self.tp_size if c.peer else 1  # every rank's copy of the instruction signals it
            if n != c.count:
                raise AssertionError(f"counter {c.name} is signalled {n} times per step, expected {c.count}")
        if errors := cluster_mate_errors(self.queues):
            raise AssertionError("; ".join(errors[:4]))
        if errors := loader_wait_errors(self.queues, self.spec.num_layers):
            raise AssertionError("; ".join(errors[:4]))


def row_blocks(rows: int, row_bytes: int, num_sms: int, cfg: ProgramConfig,
               granule: int | None = None, copies: int = 1) -> list[tuple[int, int]]:
    """Split ``rows`` into blocks of whole granules (default: tile_rows), choosing the block size that minimises the
    stage's makespan over ``num_sms`` in the cost model (weight bytes plus the fixed per-instruction cost), capped
    by ``max_block_bytes``; ties go to larger blocks. ``copies``: the stage runs every block that many times (an
    MoE layer's routing slots, each over its own expert's rows)."""
    tr = granule or cfg.tile_rows
    if rows % tr:
        raise ValueError(f"{rows} rows are not a multiple of the {tr}-row granule")
    tiles = rows // tr
    cap = max(1, min(tiles, cfg.max_block_bytes // (tr * row_bytes)))
    tile_bytes = tr * row_bytes

    def makespan(p: int) -> int:  # the busiest SM's cost for this stage, per-instruction overhead included
        return math.ceil(copies * math.ceil(tiles / p) / num_sms) * (p * tile_bytes + cfg.fixed_cost_bytes)

    best = min(range(1, cap + 1), key=lambda p: (makespan(p), -p))
    out, r = [], 0
    while r < rows:
        n = min(best * tr, rows - r)
        out.append((r, n))
        r += n
    return out


def can_pair(spec: ModelSpec, num_sms: int, cfg: ProgramConfig) -> bool:
    """Whether ATTN_IN runs in cluster pairs: allowed, an even SM count, and a row of two column tiles or more."""
    return cfg.clusters and num_sms % 2 == 0 and -(-spec.hidden_size // cfg.tile_k) >= 2


def qkv_parts(spec: ModelSpec, num_sms: int, cfg: ProgramConfig) -> int:
    """Column parts per ATTN_IN head: a layer has only Hq + 2*Hkv heads (48 for Llama 1B/8B), too few to keep 132 SMs
    streaming, so each head is split over its columns: two with cluster pairs; otherwise the count minimises the
    stage's makespan in the cost model (each part pays the fixed cost and, when split, the ticket cost; at most 8
    parts, never more than the column tiles); within 5% of the best, fewer parts win."""
    if cfg.qkv_parts:
        return cfg.qkv_parts
    if can_pair(spec, num_sms, cfg):
        return 2
    heads, kt = spec.num_heads + 2 * spec.num_kv_heads, -(-spec.hidden_size // cfg.tile_k)
    head_bytes = spec.head_dim * spec.hidden_size * 2

    def makespan(n: int) -> float:
        per_part = head_bytes / n + cfg.fixed_cost_bytes + (cfg.ticket_cost_bytes if n > 1 else 0)
        return math.ceil(heads * n / num_sms) * per_part

    options = range(1, min(8, kt) + 1)
    best = min(makespan(n) for n in options)
    return min(n for n in options if makespan(n) <= 1.05 * best)


def attention_splits(spec: ModelSpec, shape: StepShape, num_sms: int, cfg: ProgramConfig) -> tuple[int, ...]:
    """Splits of every attention query block (``StepShape.attn_groups``): the SMs shared out over the (block, KV
    head) pairs, at least ``min_split_tokens`` positions a split at the context hint (``min_block_split_tokens``
    for a block of several tokens, whose combine merges each token's partials), at most ``max_splits``."""
    groups = shape.attn_groups
    per_seg = max(1, num_sms // (spec.num_kv_heads * len(groups)))
    cap = cfg.max_splits or per_seg

    def splits(seg: int, segs: int) -> int:
        q = shape.query_tokens(seg, segs)
        least = cfg.min_block_split_tokens if q.stop - q.start > 1 else cfg.min_split_tokens
        return min(per_seg, max(1, math.ceil(shape.context_hint / least)), cap)

    return tuple(splits(s, n) for s, n in groups)


def moe_slots(spec: ModelSpec, shape: StepShape) -> int:
    """Routing slots of an MoE layer: enough for the most distinct experts M tokens can choose, min(E, M * k)."""
    return min(spec.num_experts, shape.num_tokens * spec.num_experts_per_tok) if spec.is_moe else 0


def moe_stages(spec: ModelSpec, wt: WeightTiles, l: int, slots: int, num_sms: int, cfg: ProgramConfig,
               counter, wait: int, wait_n: int) -> tuple[list[list[Instruction]], int, int]:
    """An MoE layer's ROUTER, EXPERT_IN and EXPERT_DOWN stages after its O_PROJ (``wait`` with ``wait_n``
    signals); returns them and the counter (and count) that marks x complete after the layer."""
    d, f = spec.hidden_size, spec.moe_intermediate_size
    r_blocks = row_blocks(router_rows(spec, cfg.tile_rows), 2 * d, num_sms, cfg)
    in_blocks = row_blocks(f, 2 * d * 2, num_sms, cfg, cfg.tile_rows // 2, copies=slots)
    down_blocks = row_blocks(d, 2 * f, num_sms, cfg, copies=slots)
    routed = counter(f"L{l}.router", 1)  # the finisher alone signals, once the routing table is written
    r_ticket = counter(f"L{l}.router_ticket", len(r_blocks)) if len(r_blocks) > 1 else isa.NO_COUNTER
    stages = [[Router(layer=l, row0=r, nrows=n, n_parts=len(r_blocks), ticket=r_ticket, wait=wait, wait_count=wait_n,
                      signal=routed, tiles=router_span(spec, wt, l, r, n)) for r, n in r_blocks]]
    # a slot's down projection needs only its own slot's activations
    done_in = [counter(f"L{l}.expert_in.s{j}", len(in_blocks)) for j in range(slots)]
    stages.append([ExpertIn(layer=l, row0=r, nrows=n, slot=j, wait=routed, wait_count=1, signal=done_in[j],
                            flags=isa.EXPERT_SPAN, tiles=expert_in_span(spec, wt, l, r, n))
                   for j in range(slots) for r, n in in_blocks])
    down = counter(f"L{l}.expert_down", len(down_blocks))
    tickets = {r: counter(f"L{l}.moe_ticket.r{r}", slots) if slots > 1 else isa.NO_COUNTER for r, _ in down_blocks}
    stages.append([ExpertDown(layer=l, row0=r, n_slots=slots, slot=j, ticket=tickets[r], wait=done_in[j],
                              wait_count=len(in_blocks), signal=down, flags=isa.EXPERT_SPAN,
                              tiles=expert_down_span(spec, wt, l, r, n))
                   for j in range(slots) for r, n in down_blocks])
    return stages, down, len(down_blocks)


def cost(spec: ModelSpec, shape: StepShape, ins: Instruction, cfg: ProgramConfig) -> float:
    """Bytes-equivalent cost of one instruction: the weight tiles and K/V bytes it streams, an attention split's
    ticket, and a fixed overhead."""
    b = ins.tiles.n_tiles * cfg.tile_rows * cfg.tile_k * 2
    if isinstance(ins, AttnPartial):  # its K/V, and (for one split in n) the ticket and the combine
        q = shape.query_tokens(ins.seg, ins.tokens)
        b += kv_bytes(spec, ins, shape.context_hint, q.stop - q.start, cfg.kv_row_bytes)
        if ins.ticket != isa.NO_COUNTER:
            b += cfg.ticket_cost_bytes
    elif isinstance(ins, Reduce):  # every rank's fp32 partial of its rows
        b += ins.n_ranks * ins.nrows * shape.num_tokens * 4
    return b + cfg.fixed_cost_bytes


def build_program(spec: ModelSpec, shape: StepShape, num_sms: int, cfg: ProgramConfig = ProgramConfig()) -> Program:
    if num_sms <= 0:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    ranks = TensorParallel(spec, *cfg.tp, cfg.tile_rows).size  # refuses a split that is not whole
    spec = shard_spec(spec, ranks, cfg.tile_rows)  # the rank's shard (the model itself on one GPU)
    peer = isa.PEER if ranks > 1 else 0
    counters: list[Counter] = []

    def counter(name: str, count: int, peer: bool = False) -> int:
        counters.append(Counter(name, count, peer))
        return len(counters) - 1

    def peer_counters(name: str, blocks: list[tuple[int, int]]) -> dict[int, int]:
        """One peer counter a row block: each rank's partial of the rows signals it on every rank."""
        return {r: counter(f"{name}.r{r}", ranks, True) for r, _ in blocks}

    def reductions(layer: int, kind: int, blocks: list[tuple[int, int]], waits: dict[int, int],
                   signal: int) -> list[Instruction]:
        return [Reduce(layer=layer, row0=r, nrows=n, kind=kind, n_ranks=ranks, wait=waits[r], wait_count=ranks,
                       signal=signal) for r, n in blocks]

    L, hq, hkv, g = spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.group_size
    wt = WeightTiles.for_spec(spec, cfg.tile_rows, cfg.tile_k)
    n_splits = attention_splits(spec, shape, num_sms, cfg)
    n_parts = qkv_parts(spec, num_sms, cfg)
    if not 1 <= n_parts <= min(8, -(-spec.hidden_size // cfg.tile_k)):
        raise ValueError(f"qkv_parts={n_parts} must be between 1 and the {spec.hidden_size}-column row's tile count "
                         "(at most 8)")
    pair_qkv = can_pair(spec, num_sms, cfg) and n_parts == 2
    if not 0 <= cfg.down_parts <= -(-spec.intermediate_size // cfg.tile_k):
        raise ValueError(f"down_parts={cfg.down_parts} must be between 0 and the {spec.intermediate_size}-column "
                         "row's tile count")
    groups = shape.attn_groups  # attention's query blocks: (first segment, segments)
    o_blocks = row_blocks(spec.hidden_size, spec.q_size * 2, num_sms, cfg)
    # MLP_IN: a weight tile holds tile_rows/2 gate and tile_rows/2 up rows (host/pack.py), so blocks of outputs
    # come in tile_rows/2 steps (896 blocks instead of 448 for the 8B's 132 SMs: a 3% makespan excess, not 18%)
    dense = bool(spec.mlp_layers)  # an MoE model may have no dense MLP at all
    mlp_blocks = row_blocks(spec.intermediate_size, 2 * spec.hidden_size * 2, num_sms, cfg, cfg.tile_rows // 2) \
        if dense else []
    down_blocks = row_blocks(spec.hidden_size, spec.intermediate_size * 2, num_sms, cfg) if dense else []
    lm_blocks = row_blocks(spec.vocab_size, spec.hidden_size * 2, num_sms, cfg)
    slots = moe_slots(spec, shape)
    # DOWN_PROJ's row blocks in column halves on cluster mates, where they leave half the SMs idle or more
    pair_down = (pair_qkv and 2 * len(down_blocks) <= num_sms
                 and -(-spec.intermediate_size // cfg.tile_k) > 1)

    stages: list[list[Instruction]] = []
    prev, prev_n = isa.NO_COUNTER, 0  # counter that marks the residual stream x complete for this layer
    for l in range(L):
        # ATTN_PARTIAL of KV group k waits for its G q heads and its K and V heads (their finishers)
        qkv = [counter(f"L{l}.qkv.kv{k}", g + 2) for k in range(hkv)]

        def group(h: int) -> int:  # which KV group a q/k/v head feeds
            return h // g if h < hq else (h - hq) % hkv

        ticketed = n_parts > 1 and not pair_qkv
        tickets = [counter(f"L{l}.qkv_ticket.h{h}", n_parts) if ticketed else isa.NO_COUNTER
                   for h in range(hq + 2 * hkv)]
        pair = isa.CLUSTER_PAIR if pair_qkv else 0  # part 1 of a pair hands its sums to part 0: no signal
        stages.append([AttnIn(layer=l, head=h, part=p, n_parts=n_parts, ticket=tickets[h], wait=prev,
                              wait_count=prev_n, signal=isa.NO_COUNTER if pair and p else qkv[group(h)],
                              flags=pair, tiles=attn_in_span(spec, wt, l, h, p, n_parts))
                       for h in range(hq + 2 * hkv) for p in range(n_parts)])
        attn = counter(f"L{l}.attn_out", hkv * len(groups))
        # the last split of each (kv head, query block) to draw its ticket combines the splits, every token's
        tick = {(k, b): counter(f"L{l}.attn_ticket.kv{k}.seg{groups[b][0]}", n_splits[b]) if n_splits[b] > 1
                else isa.NO_COUNTER for k in range(hkv) for b in range(len(groups))}
        stages.append([AttnPartial(layer=l, kv_head=k, seg=s, tokens=n, split=i, n_splits=n_splits[b],
                                   ticket=tick[k, b], wait=qkv[k], wait_count=g + 2, signal=attn)
                       for k in range(hkv) for b, (s, n) in enumerate(groups) for i in range(n_splits[b])])
        if ranks > 1:  # the rank's partial to every rank's inbox, then the rows' sums on each rank
            po = peer_counters(f"L{l}.o_peer", o_blocks)
            stages.append([OProj(layer=l, row0=r, nrows=n, wait=attn, wait_count=hkv * len(groups), signal=po[r],
                                 flags=peer, tiles=o_span(spec, wt, l, r, n)) for r, n in o_blocks])
            o = counter(f"L{l}.o_reduce", len(o_blocks))
            stages.append(reductions(l, O_SUM, o_blocks, po, o))
        else:
            o = counter(f"L{l}.o_proj", len(o_blocks))
            stages.append([OProj(layer=l, row0=r, nrows=n, wait=attn, wait_count=hkv * len(groups), signal=o,
                                 tiles=o_span(spec, wt, l, r, n)) for r, n in o_blocks])
        if spec.is_moe_layer(l):
            moe, prev, prev_n = moe_stages(spec, wt, l, slots, num_sms, cfg, counter, o, len(o_blocks))
            stages += moe
            continue
        mlp = counter(f"L{l}.mlp_in", len(mlp_blocks))
        stages.append([MlpIn(layer=l, row0=r, nrows=n, wait=o, wait_count=len(o_blocks), signal=mlp,
                             tiles=mlp_span(spec, wt, l, r, n)) for r, n in mlp_blocks])
        # the rows' counter (tensor parallelism: one peer counter a row block, the partials' sums after)
        pd = peer_counters(f"L{l}.down_peer", down_blocks) if ranks > 1 else {}
        down = isa.NO_COUNTER if ranks > 1 else counter(f"L{l}.down_proj", len(down_blocks))
        sig = pd or {r: down for r, _ in down_blocks}
        if pair_down:  # column halves on cluster mates: part 0 finishes the rows and alone signals
            stages.append([DownProj(layer=l, row0=r, nrows=n, part=p, n_parts=2, wait=mlp,
                                    wait_count=len(mlp_blocks), signal=isa.NO_COUNTER if p else sig[r],
                                    flags=isa.CLUSTER_PAIR | peer, tiles=down_span(spec, wt, l, r, n, p, 2))
                           for r, n in down_blocks for p in range(2)])
        elif cfg.down_parts > 1:  # column parts behind a ticket a row block: the last to draw it finishes, signals
            nd = cfg.down_parts
            dt = {r: counter(f"L{l}.down_ticket.r{r}", nd) for r, _ in down_blocks}
            stages.append([DownProj(layer=l, row0=r, nrows=n, part=p, n_parts=nd, ticket=dt[r], wait=mlp,
                                    wait_count=len(mlp_blocks), signal=sig[r], flags=peer,
                                    tiles=down_span(spec, wt, l, r, n, p, nd))
                           for r, n in down_blocks for p in range(nd)])
        else:
            stages.append([DownProj(layer=l, row0=r, nrows=n, wait=mlp, wait_count=len(mlp_blocks), signal=sig[r],
                                    flags=peer, tiles=down_span(spec, wt, l, r, n)) for r, n in down_blocks])
        if ranks > 1:
            down = counter(f"L{l}.down_reduce", len(down_blocks))
            stages.append(reductions(l, DOWN_SUM, down_blocks, pd, down))
        prev, prev_n = down, len(down_blocks)
    pl = peer_counters("lm_peer", lm_blocks) if ranks > 1 else {}
    stages.append([LmHead(layer=0, row0=r, nrows=n, wait=prev, wait_count=prev_n, signal=pl.get(r, isa.NO_COUNTER),
                          flags=peer, tiles=lm_span(spec, wt, r, n)) for r, n in lm_blocks])
    if ranks > 1:  # every rank gathers every shard's logits; nobody waits for them inside the step
        stages.append(reductions(0, LM_GATHER, lm_blocks, pl, isa.NO_COUNTER))

    queues: list[list[Instruction]] = [[] for _ in range(num_sms)]
    total = [0.0] * num_sms
    for stage in stages:
        if stage and stage[0].flags & isa.CLUSTER_PAIR:  # pairs go to cluster mates
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
    prog = Program(spec, shape, num_sms, cfg, queues, counters, n_splits, n_parts, wt, total, slots)
    prog.validate()
    return prog


def place_pairs(spec: ModelSpec, shape: StepShape, cfg: ProgramConfig, stage: list[Instruction],
                queues: list[list[Instruction]], total: list[float]) -> None:
    """Place a stage of cluster pairs (parts 0 and 1 of each head or row block, in that order): each pair to the
    cluster (SMs 2c, 2c + 1) with the least load in this stage, ties to the least total load,
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


# an instruction's place in the step's stage order (layer, stage): what any instruction waits for comes earlier
_STAGE = {isa.Op.ATTN_IN: 0, isa.Op.ATTN_PARTIAL: 1, isa.Op.O_PROJ: 2, isa.Op.MLP_IN: 3, isa.Op.ROUTER: 3,
          isa.Op.DOWN_PROJ: 4, isa.Op.EXPERT_IN: 4, isa.Op.EXPERT_DOWN: 5, isa.Op.LM_HEAD: 0}


def stage_key(ins: Instruction, num_layers: int) -> tuple[int, int]:
    return (num_layers if ins.OP == isa.Op.LM_HEAD else ins.layer, _STAGE.get(ins.OP, 0))


def loader_wait_errors(queues: list[list[Instruction]], num_layers: int) -> list[str]:
    """Why a GPU loader could wait forever on a routing entry (empty: it cannot). The loader of a queue stops at an
    expert span of layer l (isa.EXPERT_SPAN) until layer l's ROUTER finisher stores the entry, so no queue may hold,
    after such an instruction, a ROUTER of layer l or anything of an earlier stage (everything the routers wait for,
    directly or not): every instruction after it must be of layer l's expert stages or later (device/ring.py)."""
    out = []
    for s, q in enumerate(queues):
        bar, where = None, None  # the latest expert instruction's stage so far: what later ones must not precede
        for i, ins in enumerate(q):
            key = stage_key(ins, num_layers)
            if bar is not None and key < bar:
                out.append(f"SM {s}: {ins} (position {i}) comes after the expert span at position {where}: its "
                           "loader could wait on a router that waits for it")
            if ins.flags & isa.EXPERT_SPAN:
                bar, where = (ins.layer, 4), i
    return out


def cluster_mate_errors(queues: list[list[Instruction]]) -> list[str]:
    """Why the cluster pairs of ``queues`` cannot meet (empty: they can): the k-th CLUSTER_PAIR instruction of SM
    2c must be part 0 and the k-th of SM 2c + 1 part 1 of the same pair (``mate_key``), both queues holding equally
    many."""
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
