"""Step state and scratch buffers of one megakernel program: the memory contract between host, VM and kernel.

Step state (int32, refilled by the host before every step in one copy: ``StepState.fill``; everything else is
written by the kernel):
  tokens [M]              token id of each token in the step
  positions [M]           absolute position of each token in its sequence
  seg_ctx [S]             context length of each segment after this step (= last position + 1)
  seg_new [S]             the first position this step writes in each segment's sequence: the segment's own first
                          position, or, for a segment that continues rows of its sequence another segment of the step
                          writes (a verify block run as one-token segments: launch/decoder.py), that block's first
                          position. The multi-token GPU kernel reads positions below it before its dependency
                          wait (attention's prefetch), never those at or above it; the one-token kernel and the VM
                          do not read it.
  block_tables [S, P]     page ids of each segment's sequence (kv/pages.py layout)
  counters [C + 2]        dependency counters (never reset), then ``DONE`` (CTAs finished) and ``EPOCH`` (steps run)
Token m belongs to the segment s with seg_start[s] <= m < seg_start[s] + seg_len[s]; seg_start/seg_len are part of
the program's StepShape and static.

Scratch (fp32, written and read within one step; the host never needs to clear it):
  x [M, D]                     residual stream (valid after a layer's DOWN_PROJ; layer 0 reads the embedding rows)
  qkv_part [P, M, Hq+2Hkv, hd] ATTN_IN's partial products, one per column part (P = program.qkv_parts, or more
                               where the GPU keeps ticketed DOWN_PROJ parts' sums here: qkv_part_slots)
  q [M, Hq, hd]                query heads after bias, q-norm and RoPE
  part_o [M, Hq, SPLITS, hd]   unnormalised partial attention outputs   sum_j exp(s_j - m) v_j
  part_ml [M, Hq, SPLITS, 2]   running max m (scaled scores, natural log domain) and sum l = sum_j exp(s_j - m);
                               an empty split stores m = EMPTY_M, l = 0, o = 0
  attn [M, Hq*hd]              attention output (input of O_PROJ)
  down_part [P, M, D]          DOWN_PROJ's column parts (P = program.down_parts; [1, M, D] unused without parts):
                               each part's sums (a cluster pair's halves meet in the GPU's shared memory instead,
                               device/cluster.py; ticketed parts store here)
  act [M, I]                   SiLU(gate) * up (input of DOWN_PROJ)
  logits [M, V]                (tensor parallelism: every rank's, gathered by REDUCE; peers.py holds the inboxes)
bf16, the multi-token GPU kernel's staging sources (device/matvec_mt.py; the one-token kernel and the VM leave them
unwritten): each CTA copies an instruction's input rows from them into shared memory in one round of async copies
  x16 [M, D]                   x rounded to bf16, written beside x by every writer of x
  attn16 [M, Hq*hd]            the attention output rounded to bf16 (its only reader, O_PROJ, rounds it so)
  act16 [M, I]                 SiLU(gate) * up rounded to bf16 (its only reader, DOWN_PROJ, rounds it so)
  moe_act16 [S, M, F]          an MoE layer's moe_act rounded to bf16 (its only reader, EXPERT_DOWN, rounds it so)
MoE layers (program.moe_slots = S routing slots; empty for a dense model; E experts padded to Ep rows, F their
intermediate size):
  router_logits [M, Ep]        ROUTER's logits (the first E columns are the experts')
  routed [L, S] int32          the routing table: layer l's slot j = isa.route_entry(expert, epoch), written once a
                               step by the layer's ROUTER finisher and read by the loader (expert spans) and by
                               EXPERT_IN / EXPERT_DOWN; never needs clearing (entries carry their step's tag)
  slot_w [S, M]                each slot's routing weight for each token (0: the token did not choose it)
  moe_act [S, M, F]            each slot's SiLU(gate) * up (input of EXPERT_DOWN)
  moe_part [S, M, D]           each slot's weighted down projection, summed into x by the row block's finisher
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..step_inputs import Field, StepInputs
from .tiles import router_rows

if TYPE_CHECKING:
    from .program import Program

EMPTY_M = -1.0e30  # finite "minus infinity": exp(EMPTY_M - m) == 0 without inf - inf = nan


def state_fields(num_tokens: int, num_segments: int, max_pages: int) -> tuple[Field, ...]:
    """The step state's inputs in their ``StepInputs`` buffer: the per-token and per-segment arrays, then
    ``table_rows`` (the segments' block tables packed at the step's width: [S * width], copied only as far as the
    step uses it) and, on the device only, ``block_tables`` [S, P] (the kernel's, at its fixed row stride P, written
    from table_rows on the device)."""
    m, s = num_tokens, num_segments
    return (Field("tokens", torch.int32, (m,)), Field("positions", torch.int32, (m,)),
            Field("seg_ctx", torch.int32, (s,)), Field("seg_new", torch.int32, (s,)),
            Field("table_rows", torch.int32, (s * max_pages,)),
            Field("block_tables", torch.int32, (s, max_pages), host=False))


class StepState:
    """The step's inputs (views into one ``StepInputs`` buffer: tokens, positions, seg_ctx, seg_new, block_tables)
    and the counters (the kernel's; the host never writes them after allocation)."""

    def __init__(self, inputs: StepInputs, counters: torch.Tensor):
        self.inputs, self.counters = inputs, counters
        self.tokens, self.positions = inputs["tokens"], inputs["positions"]
        self.seg_ctx, self.seg_new, self.block_tables = inputs["seg_ctx"], inputs["seg_new"], inputs["block_tables"]

    @property
    def done_index(self) -> int:
        return self.counters.numel() - 2

    @property
    def epoch_index(self) -> int:
        return self.counters.numel() - 1

    @property
    def epoch(self) -> int:
        return int(self.counters[self.epoch_index])

    def fill(self, tokens: Sequence[int] | torch.Tensor, seg_starts_pos: Sequence[int],
             block_tables: Sequence[Sequence[int]], seg_lens: Sequence[int],
             seg_new: Sequence[int] | None = None) -> None:
        """Set the step's inputs: ``tokens`` [M] (host ints, or a tensor: a device tensor, e.g. the previous step's
        samples not yet on the host, is copied on the device); for each segment its first position and block table,
        and (default: that first position) the first position the step writes in its sequence (at most the
        segment's first). The host values are packed with numpy into the next pinned host buffer and go in one
        non-blocking copy (``StepInputs.load``), then the tables' used width is spread into the kernel's rows and
        a device tensor of tokens is copied, all queued in stream order before the launch: nothing waits for the
        GPU."""
        lens = np.asarray(seg_lens, dtype=np.int64)
        starts = np.asarray(seg_starts_pos, dtype=np.int64)
        m, ns = int(lens.sum()), len(lens)
        if len(tokens) != m:
            raise ValueError(f"{len(tokens)} tokens for segments totalling {m}")
        new = starts if seg_new is None else np.asarray(seg_new, dtype=np.int64)
        if len(new) != ns or ((new < 0) | (new > starts)).any():
            raise ValueError(f"seg_new {new.tolist()}: one first written position per segment, between 0 and its "
                             f"own first position {starts.tolist()}")
        # only the tables' used width is written: entries past a table's end are never read (every read is of a
        # position below the segment's context), so a step costs O(pages in use), not O(table width)
        width = max(len(t) for t in block_tables)
        if width > self.block_tables.shape[1]:
            s = max(range(len(block_tables)), key=lambda i: len(block_tables[i]))
            raise ValueError(f"segment {s}: block table of {width} pages exceeds {self.block_tables.shape[1]}")
        host = self.inputs.stage(self.inputs.end("table_rows", ns * width))
        on_host = not isinstance(tokens, torch.Tensor)
        if on_host:
            host.array("tokens")[:] = tokens
        first = np.repeat(np.cumsum(lens) - lens, lens)  # each token's segment's first token
        host.array("positions")[:] = np.repeat(starts, lens) + np.arange(m) - first
        host.array("seg_ctx")[:] = starts + lens
        host.array("seg_new")[:] = new
        rows = host.array("table_rows", ns * width).reshape(ns, width)
        rows[:] = 0
        for i, t in enumerate(block_tables):
            rows[i, :len(t)] = t
        self.inputs.load(host)
        self.inputs.spread("table_rows", "block_tables", ns, width)
        if not on_host:
            self.tokens.copy_(tokens)


@dataclass
class Scratch:
    x: torch.Tensor
    qkv_part: torch.Tensor
    q: torch.Tensor
    part_o: torch.Tensor
    part_ml: torch.Tensor
    attn: torch.Tensor
    act: torch.Tensor
    logits: torch.Tensor
    down_part: torch.Tensor
    router_logits: torch.Tensor
    routed: torch.Tensor
    slot_w: torch.Tensor
    moe_act: torch.Tensor
    moe_part: torch.Tensor
    x16: torch.Tensor
    attn16: torch.Tensor
    act16: torch.Tensor
    moe_act16: torch.Tensor

    def poison(self) -> None:
        """NaN in every fp32 and bf16 buffer; the routing table back to never written (no step's tag)."""
        for t in (self.x, self.qkv_part, self.q, self.part_o, self.part_ml, self.attn, self.act, self.logits,
                  self.down_part, self.router_logits, self.slot_w, self.moe_act, self.moe_part, self.x16,
                  self.attn16, self.act16, self.moe_act16):
            t.fill_(float("nan"))
        self.routed.zero_()


def unspecialized(n: int) -> int:
    """``n``, or ``n + 1`` where the JIT would compile an int argument of value ``n`` apart: Triton specializes an
    int that equals 1 (a constant) or is a multiple of 16 (a divisibility hint), so a size the program's layout
    moves (its queue length, counters, splits) would compile one kernel for each class it falls in. Sizes the kernel
    takes as arguments are padded to this: every layout of a bucket finds the one compiled kernel."""
    return n + 1 if n == 1 or n % 16 == 0 else n


def counter_slots(prog: Program) -> int:
    """The kernel's counter table's counters (``num_counters``: DONE and EPOCH follow): the program's, padded to
    ``unspecialized`` with counters no instruction names."""
    return unspecialized(len(prog.counters))


def split_slots(prog: Program) -> int:
    """The splits' stride of ``part_o``/``part_ml`` (the kernel's ``splits``): the program's most splits a segment,
    padded to ``unspecialized``."""
    return unspecialized(prog.max_splits)


def alloc_state(prog: Program, max_pages: int, device: torch.device | str = "cpu") -> StepState:
    inputs = StepInputs(state_fields(prog.shape.num_tokens, len(prog.shape.seg_lens), max_pages), device)
    return StepState(inputs, torch.zeros(counter_slots(prog) + 2, dtype=torch.int32, device=device))


def qkv_part_slots(prog: Program) -> int:
    """qkv_part's leading size: ATTN_IN's column parts, or more where ticketed DOWN_PROJ parts need the room (the GPU
    keeps their [parts, M, D] sums in this buffer, free from a layer's DOWN_PROJ until the next layer's ATTN_IN)."""
    sp = prog.spec
    n = prog.qkv_parts
    if prog.down_parts > 1 and not prog.down_pairs:
        n = max(n, -(-prog.down_parts * sp.hidden_size // ((sp.num_heads + 2 * sp.num_kv_heads) * sp.head_dim)))
    return n


def alloc_scratch(prog: Program, device: torch.device | str = "cpu") -> Scratch:
    sp, m, s = prog.spec, prog.shape.num_tokens, prog.moe_slots
    f = lambda *shape: torch.full(shape, float("nan"), dtype=torch.float32, device=device)  # noqa: E731
    h = lambda *shape: torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)  # noqa: E731
    return Scratch(
        x=f(m, sp.hidden_size),
        qkv_part=f(qkv_part_slots(prog), m, sp.num_heads + 2 * sp.num_kv_heads, sp.head_dim),
        q=f(m, sp.num_heads, sp.head_dim),
        part_o=f(m, sp.num_heads, split_slots(prog), sp.head_dim),
        part_ml=f(m, sp.num_heads, split_slots(prog), 2),
        attn=f(m, sp.q_size),
        act=f(m, sp.intermediate_size),
        logits=f(m, prog.logits_width),  # the whole vocabulary, tensor parallelism included
        down_part=f(prog.down_parts, m, sp.hidden_size),
        router_logits=f(m, router_rows(sp, prog.config.tile_rows) if sp.is_moe else 0),
        routed=torch.zeros(sp.num_layers, s, dtype=torch.int32, device=device),  # 0: never written
        slot_w=f(s, m),
        moe_act=f(s, m, sp.moe_intermediate_size),
        moe_part=f(s, m, sp.hidden_size),
        x16=h(m, sp.hidden_size),
        attn16=h(m, sp.q_size),
        act16=h(m, sp.intermediate_size),
        moe_act16=h(s, m, sp.moe_intermediate_size),
    )


def split_range(ctx: int, split: int, n_splits: int, new: int = 1) -> tuple[int, int]:
    """Positions [lo, hi) of attention split ``split`` over a context of ``ctx`` positions (possibly empty), whose
    last ``new`` are this step's tokens: the ``ctx - new`` past positions go in chunks of ``ceil((ctx - new) /
    n_splits)``, and the last split also takes this step's positions. So the past blocks of a split do not grow by
    a step's tokens (context 1024 on 16 splits: 64 past positions each, one 64-position block on the GPU, not 65),
    and the split that holds this step's rows is always the last (the GPU reads them after its wait, with q)."""
    past = max(ctx - new, 0)
    chunk = -(-past // n_splits)
    lo = min(past, split * chunk)
    return lo, (ctx if split == n_splits - 1 else min(past, lo + chunk))
