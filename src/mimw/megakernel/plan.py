"""Plan once: a model, a step shape and the GPU's SM count -> everything one megakernel launch needs.

``Tuning`` holds the kernel's real tuning knobs (each measured; bench/NOTES.md). ``plan`` derives the rest from the
shape, so a fallback that a shape forces is decided here, never offered as a flag:
  * the weight tile shape: [32, 256], or [16, 512] where a head is too small for two 32-row tiles;
  * cluster pairs (device/cluster.py): on where the SM count is even and a row has two column tiles or more
    (``program.can_pair``), off otherwise; the launch code re-plans without them where the GPU cannot keep every
    cluster resident;
  * the staging buffer: rows for the widest staged input, DOWN_PROJ's input counted as a half where it runs in
    cluster pairs (each half stages its own columns);
  * the ring: as many slots as fit in shared memory beside the staging buffer, the compiler's scratch and the
    cluster exchange region;
  * ATTN_PARTIAL's warps merge their softmax states through the staging buffer where it holds them (else through
    Triton's reductions over the warp axis); its block (``attn_block``) and a group's splits (``combine_splits``)
    shrink where a KV group has more than four query heads, so its registers hold;
  * the KV cache's element type (``kv_dtype``: bf16, or fp8 e4m3 with a bf16 scale per (token, head), kv/pages.py):
    ``Constants.FP8``, the attention block (``attn_block``: as many positions as 8 KB of K; a multi-token step's as
    many as bf16's) and the cost model's K/V bytes follow it; it is the cache's, never a tuning knob;
  * the ring walk of a split: on the tensor cores where a slot holds 16 positions a warp or more
    (``attn_ring_mma.applies``: every fp8 slot of the shipping shapes, bf16's at head_dim 64), else on the CUDA
    cores, each lane its own online softmax (the bf16 slot of 32 positions at head_dim 128: the 8B's);
  * every one-token attention split's past K/V through the ring, a one-token step's and a multi-token step's
    one-token groups' over a bf16 cache (a decode batch's, a mixed step's single tokens; a query block of several
    tokens keeps its cp.async stages; over an fp8 cache a multi-token step's splits request each block with its
    scales: its ring walk spills the 8B's registers): ``kv_ring``: the loader streams each split's positions into
    ring slots, ``KVS`` positions of K and V a slot, in TMA boxes of ``KVBOX`` rows of one page and head; an fp8
    cache's scales beside the ring, ``kv_scale_bytes`` a slot; a multi-token ring's slots are the same 16 KB,
    ``MIN_RING_MT`` of them at least, so they hold a slot at every shape; a page size whose boxes TMA cannot
    address is refused;
  * the release hold's marks on the words (hold.py);
  * a multi-token step (M = 2..``max_tokens`` one-token segments: decode tokens, a verify block's tokens): the
    tokens padded to MB = 8, 16 or 32 (``token_rows``; wgmma's N is a chunk pair's 2 MB), the staging buffer MB
    bf16 rows a 32-column chunk and a norm's weights beside it, no cluster pairs (their exchange holds one token's
    sums: ATTN_IN's parts combine through tickets), and DOWN_PROJ in ticketed column parts: at least two, and as
    few as let its staged input fit beside a ring of ``MIN_RING_MT`` slots.
  * mixture-of-experts layers (ROUTER, EXPERT_IN, EXPERT_DOWN): the staging buffer also holds an expert's
    activation (EXPERT_DOWN's input); over a bf16 KV cache only (an fp8 one is refused: not checked together).
A program with an instruction that has no device code (ops.GPU_OPS) is refused.
Pure host logic (CPU-tested): ``LaunchPlan.constants`` are the kernel's compile-time constants and ``words`` its
program; launch/decoder.py allocates and launches, launch/compile.py compiles the same plan for sm_90a on the CPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..kv import fp8
from ..models.spec import ModelSpec
from .hold import check_marks, hold_marks, mark_words
from .isa import Op
from .ops import GPU_OPS, attn_ring_mma
from .program import Program, ProgramConfig, StepShape, attention_splits, build_program
from .tensor_parallel import shard_spec
from .tiles import router_rows

SHARED_BYTES = 232448  # the most dynamic shared memory one CTA may use on sm_90 (227 KB)
SCRATCH_BYTES = 8 * 1024  # kept for the compiler's own shared scratch (layout conversions, reductions, barriers:
# ~4.3 KB in the default kernels); every kernel the compile tests build is checked to fit
MMA_K = 32  # columns of a folded tile row (device/matvec.dot_tile): two k16 steps of mma.sync
MAX_BATCH = 32  # the most tokens a multi-token step plans (swap-AB: a chunk pair of the tokens is wgmma's N); fewer
# where the staged input of that many does not fit (``max_tokens``: the 8B shapes' 4096 columns, 16)
MIN_RING_MT = 4  # the fewest ring slots a multi-token plan keeps beside its staging buffer
MAX_MOE_BATCH = 8  # the most tokens a multi-token step of an MoE model plans (MB = 8)
MAX_QUERY_BLOCK = 16  # the most tokens of one attention query block (StepShape.attn_blocks): its query rows are
# tokens x the group's heads on mma.sync (16 x 4 = 64 rows, 16 a warp), its partials' combine a token at a time
MIN_QUERY_BLOCK = 9  # over a bf16 cache a segment of fewer tokens attends token by token, as a decode batch's do:
# there a query block lost to its tokens' ring walks on both shapes (bench/NOTES.md, "Short verify blocks token by
# token"); ``min_query_block`` gives the fp8 cache's


def min_query_block(kv_dtype: torch.dtype) -> int:
    """The fewest tokens of a segment that attend as one query block over a cache of ``kv_dtype``: MIN_QUERY_BLOCK
    over bf16, where a multi-token step's one-token groups stream their past K/V through the ring; 2 over fp8, where
    they have no ring (``kv_ring``) and request each block with its scales: every verify block there stays one
    query block, the path measured over fp8 (bench/NOTES.md, "Query blocks over an fp8 cache"); token by token over
    fp8 is unmeasured."""
    return 2 if kv_dtype == fp8.FP8 else MIN_QUERY_BLOCK


@dataclass(frozen=True)
class Tuning:
    """The megakernel's tuning knobs (measured: bench/NOTES.md, "What was tried")."""

    tile_rows: int = 0  # TR: weight tile rows (0: 32, or 16 where a head has fewer than 64 rows)
    tile_k: int = 0  # TK: weight tile columns (0: 256, or 512 with 16-row tiles): 16 KB tiles
    ring: int = 0  # NB: ring slots (0: as many as fit in shared memory)
    num_warps: int = 4  # compute partition warps
    loader_regs: int = 48  # register budget of the one-warp loader partition
    inflight: int = 4  # weight tiles the loader may have requested and not yet landed: fewer requests queued in
    # the memory system shorten every round trip the step's hops make (the release fences, polls, stagings)
    quiet: int = 2  # the release hold: tiles of a new stage's streaming instruction the loader requests before
    # the SM's previous streaming release (-1: no hold); the release's fence then meets fewer tiles in flight
    qkv_parts: int = 0  # ATTN_IN column parts per head (0: two with cluster pairs, else the cost model's choice)
    min_split_tokens: int = 32  # attention splits get at least this many positions at the context hint
    min_block_split_tokens: int = 256  # ... a query block's of several tokens at least this many
    fixed_cost_kb: int = 96  # the scheduler's per-instruction cost in weight kilobytes
    max_block_kb: int = 1024  # cap on one matvec instruction's weight kilobytes
    clusters: bool = True  # cluster pairs where the shape can form them (False: tickets everywhere)
    trace: bool = False  # record [start, dependency met, outputs stored, signalled] per instruction (tools/trace.py)

    @classmethod
    def parse(cls, text: str) -> "Tuning":
        """``"inflight=4,quiet=0"`` -> Tuning with those fields (ints; booleans as 1/0/true/false). Unknown names and
        bad values raise ValueError naming what is accepted; the empty string is the default."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        out: dict = {}
        for item in (t.strip() for t in text.split(",")):
            if not item:
                continue
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in types:
                raise ValueError(f"megakernel option {item!r}: expected NAME=VALUE with NAME one of "
                                 f"{', '.join(sorted(types))}")
            if types[name] in (bool, "bool"):
                if value.lower() not in ("1", "0", "true", "false"):
                    raise ValueError(f"megakernel option {name}={value!r}: expected 1/0/true/false")
                out[name] = value.lower() in ("1", "true")
            else:
                try:
                    out[name] = int(value)
                except ValueError:
                    raise ValueError(f"megakernel option {name}={value!r}: expected an integer") from None
        return cls(**out)

    def resolve(self, spec: ModelSpec) -> "Tuning":
        """The tile shape filled in for ``spec``."""
        if self.tile_rows and self.tile_k:
            return self
        small = spec.head_dim % 64 != 0
        return dataclasses.replace(self, tile_rows=self.tile_rows or (16 if small else 32),
                                   tile_k=self.tile_k or (512 if small else 256))

    def program_config(self) -> ProgramConfig:
        return ProgramConfig(tile_rows=self.tile_rows, tile_k=self.tile_k, qkv_parts=self.qkv_parts,
                             max_block_bytes=self.max_block_kb * 1024, min_split_tokens=self.min_split_tokens,
                             min_block_split_tokens=self.min_block_split_tokens,
                             fixed_cost_bytes=self.fixed_cost_kb * 1024, clusters=self.clusters)


@dataclass(frozen=True)
class Constants:
    """The kernel's compile-time constants (its one constexpr argument ``C``): model sizes, tiling and the plan's
    derived choices. Nothing about a model is compiled in beyond these."""

    D: int  # hidden size
    HQ: int  # query heads
    HKV: int  # KV heads
    HD: int  # head dim
    I: int  # noqa: E741  intermediate size
    NL: int  # layers
    PS: int  # KV page size
    HAS_BIAS: bool  # q/k/v bias (Qwen2)
    QK_NORM: bool  # per-head q/k RMSNorm (Qwen3)
    TR: int  # weight tile rows
    TK: int  # weight tile columns
    NB: int  # ring slots
    KT_ROWS: int  # staging buffer rows (column tiles of the widest staged input, a power of two)
    SG: int  # staging group: column tiles loaded at once (32 fp32 registers a thread)
    BT: int  # attention block positions
    SP2: int  # attention splits, rounded up to a power of two
    GP: int  # query heads per KV head, rounded up to a power of two
    LOADER_REGS: int
    INFLIGHT: int  # the loader's in-flight cap (0: the ring)
    QUIET: int  # the release hold (-1: off)
    XB: int  # cluster exchange bytes past Triton's shared memory (0: no cluster pairs)
    DOWN_PAIRS: bool  # DOWN_PROJ in cluster pairs, each half staging its columns from the staging buffer's row 0
    SMEM_MERGE: bool  # ATTN_PARTIAL merges its warps' states through the staging buffer
    FP8: bool  # the KV cache holds e4m3 rows with a bf16 scale each (kv/fp8.py), else bf16 rows
    TRACE: bool  # per-instruction timestamps (tools/trace.py)
    NW: int  # compute warps
    ATTN_MMA: bool = False  # a one-token split's ring walk on mma.sync (ops/attn_ring_mma.py), where a slot holds
    # 16 positions a warp or more (attn_ring_mma.applies); else the lanes' walk on the CUDA cores
    KVS: int = 0  # positions of K and V one ring slot holds (the loader streams one-token splits' past K/V; kv_ring)
    KVBOX: int = 1  # rows of one TMA box of K or V: a run of one page of one KV head (kv_ring)
    M: int = 1  # tokens in the step (> 1: the multi-token code paths, swap-AB wgmma; a decode batch of M segments)
    QT: int = 1  # tokens of an attention query block at most, a power of two (1: every token alone; more:
    # ATTN_PARTIAL's query-block path, ops/attn_query_block.py): the bucket's, up to MAX_QUERY_BLOCK
    QBT: int = 0  # a query block's K/V block positions (plan.query_block; 0: no query blocks)
    MB: int = 1  # tokens padded to the B operand's N (8, 16 or 32 where M > 1): staged rows a 32-column chunk
    V: int = 0  # vocabulary (the logits' row stride where M > 1)
    E: int = 0  # MoE: experts (0: a dense model)
    EP2: int = 1  # experts rounded up to a power of two (the router finisher's vector)
    EP: int = 0  # the router's rows padded to whole row tiles (router_logits' row stride)
    S: int = 0  # routing slots of an MoE layer (program.moe_slots; 0: a dense model)
    S2: int = 1  # routing slots rounded up to a power of two
    K: int = 0  # experts a token is routed to (top-k)
    F: int = 0  # an expert's intermediate size
    NORM_TOPK: bool = False  # renormalise the chosen experts' probabilities
    TP: int = 1  # tensor-parallel ranks (device/peer.py): the sizes above are then the rank's shard's (V: V / TP)

    @property
    def NQKV(self) -> int:
        return self.HQ + 2 * self.HKV

    @property
    def G(self) -> int:
        return self.HQ // self.HKV

    @property
    def KT_D(self) -> int:
        return -(-self.D // self.TK)

    @property
    def KT_Q(self) -> int:
        return -(-(self.HQ * self.HD) // self.TK)

    @property
    def KT_I(self) -> int:
        return -(-self.I // self.TK)

    @property
    def KT_F(self) -> int:
        return -(-self.F // self.TK)

    @property
    def KT_H(self) -> int:  # a DOWN_PROJ half's column tiles, at most
        return -(-self.KT_I // 2)


@dataclass
class LaunchPlan:
    spec: ModelSpec
    tuning: Tuning  # resolved
    num_sms: int
    page_size: int
    program: Program
    words: torch.Tensor  # [num_sms, max_len, NWORDS] int32, hold marks included
    lens: torch.Tensor  # [num_sms] int32
    ring: int  # NB
    hbuf_rows: int  # KT_ROWS
    exchange_bytes: int  # XB: dynamic shared memory past Triton's for the cluster exchange (0: no clusters)
    constants: Constants

    @property
    def staging_bytes(self) -> int:
        """The staging buffer: KT_ROWS column tiles of MB bf16 rows (one row for M = 1)."""
        return self.hbuf_rows * self.tuning.tile_k * 2 * self.constants.MB

    @property
    def cluster_size(self) -> int:
        return 2 if self.exchange_bytes else 1

    @property
    def grid(self) -> int:
        return self.num_sms // self.cluster_size


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


KV_DTYPES = (torch.bfloat16, fp8.FP8)  # the cache element types the kernel reads and writes


def attn_block(spec: ModelSpec, kv_dtype: torch.dtype = torch.bfloat16, num_tokens: int = 1) -> int:
    """BT: positions in one attention block, 8 KB of K (one round trip's worth): at bf16 64 for head_dim 64, 32 for
    128; at fp8 twice as many, so a round trip moves as many bytes and a split half as many round trips. A
    multi-token step (``num_tokens`` > 1) keeps bf16's positions at fp8 (4 KB of K): its kernel holds more beside
    the block (the token's step fields, block 0's late reload), and the fp8 block of twice the positions spills
    there (ptxas at 255 registers: 16 spill stores on the 1B at M = 8, 68 with the late reload). Where a KV group
    has more than four query heads (the 30B-A3B's eight) the block is bf16's shrunk by as much (16 at head_dim 128),
    at either element type, so that a thread's share of the block's [heads, positions, head_dim] products stays at
    the four-head count and the attention does not spill."""
    gp = _pow2(spec.group_size)
    if num_tokens > 1 or gp > 4:
        kv_dtype = torch.bfloat16
    return max(8, 8192 // (spec.head_dim * kv_dtype.itemsize) * 4 // max(4, gp))


def kv_ring(spec: ModelSpec, t: Tuning, page_size: int, kv_dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(KVS, KVBOX) of every step: its loader streams each one-token attention split's past K/V into the ring
    (device/ring.py): a slot holds KVS positions, K's rows then V's (the most positions, a power of two, whose
    2 * KVS rows fit the slot: 64 at bf16 and head_dim 64, 32 at 128, twice as many at fp8), which is
    ``attn_block`` for every shipping shape of four heads a group or fewer; a larger group's block (the 30B-A3B's
    16) is a part of the slot, which compute walks in blocks, and a slot smaller than the block (a smaller tile
    tuning) shrinks the block to the slot. The loader fills a slot with TMA boxes of KVBOX = gcd(page size, KVS)
    rows, each a run of one page of one KV head (kv/pages.py), so a box never crosses a page. Raises ValueError
    where TMA cannot place the boxes in a slot (a box's bytes a multiple of 128: its shared-memory address
    alignment) or, over an fp8 cache, the loader's copies of 4 bytes or more cannot carry a box's scales."""
    import math

    row = spec.head_dim * kv_dtype.itemsize
    kvs = _pow2(t.tile_rows * t.tile_k * 2 // (2 * row) + 1) // 2
    box = math.gcd(page_size, kvs)
    if (box * row) % 128 or (kv_dtype == fp8.FP8 and (box < 2 or kvs < 64)):
        raise ValueError(f"page_size={page_size}: the loader streams K/V in boxes of gcd(page_size, {kvs}) = {box} "
                         f"rows of {row} bytes, which TMA cannot place in a ring slot (a box must be a multiple of "
                         "128 bytes, and an fp8 box at least 2 rows); use a power-of-two page size of 16 or more")
    return kvs, box


def kv_scale_bytes(kvs: int, kv_dtype: torch.dtype) -> int:
    """Shared memory a ring slot needs beside it for its K/V rows' scales (fp8: KVS bf16 scales of K, then V's)."""
    return 2 * kvs * fp8.SCALE_DTYPE.itemsize if kv_dtype == fp8.FP8 else 0


def combine_splits(spec: ModelSpec, t: Tuning) -> int:
    """The most attention splits a KV group's combine loads in one round ([GP heads, splits, head_dim] fp32 over the
    compute threads, at most 128 a thread: 16 for the 30B-A3B's eight heads of 128, beyond every dense preset's
    count)."""
    per_round = 128 * 32 * t.num_warps // (_pow2(spec.group_size) * spec.head_dim)
    p = 1
    while 2 * p <= per_round:
        p *= 2
    return p


def exchange_bytes(head_dim: int) -> int:
    """Bytes of the cluster pairs' exchange region (device/cluster.py): two mbarriers, two slots of two parts'
    [head_dim] fp32 sums."""
    return 16 + 2 * 2 * head_dim * 4


def check(spec: ModelSpec, t: Tuning) -> None:
    """Raise ValueError where the resolved tuning ``t`` cannot tile ``spec`` or does not describe a kernel."""
    tr, tk = t.tile_rows, t.tile_k
    if spec.head_dim % (2 * tr):
        raise ValueError(f"head_dim {spec.head_dim} must be a multiple of 2*tile_rows ({2 * tr})")
    for name in ("hidden_size", "intermediate_size", "vocab_size"):
        if getattr(spec, name) % tr:
            raise ValueError(f"{name}={getattr(spec, name)} must be a multiple of tile_rows={tr}")
    if tr > 32:
        raise ValueError("the cluster pairs store a row tile from one owner thread an element: tile_rows <= 32")
    folds = tk // MMA_K
    if tk % MMA_K or folds % 8 or (tr * folds) % (16 * t.num_warps):
        raise ValueError(f"a [{tr}, {tk}] tile does not fold into {t.num_warps} warps' 16-row mma blocks with a "
                         f"multiple of 8 folds of {MMA_K}")
    if tk % (32 * t.num_warps):
        raise ValueError("tile_k must be a multiple of 32 * num_warps")
    if t.quiet < -1 or t.inflight < 0:
        raise ValueError(f"quiet={t.quiet} (-1 off, or >= 0), inflight={t.inflight} (0: the whole ring, or > 0)")
    if not 0 <= t.qkv_parts <= 8:
        raise ValueError(f"qkv_parts={t.qkv_parts}: 0 (derived) or 1..8 (the finisher's unrolled sum)")


def token_rows(m: int) -> int:
    """MB, the rows a multi-token step pads its M tokens to (a staged chunk's rows; wgmma's N is a chunk pair's
    2 MB): 8 up to eight tokens, 16 up to sixteen, else 32."""
    return 8 if m <= 8 else 16 if m <= 16 else 32


def max_tokens(spec: ModelSpec, tuning: Tuning = Tuning()) -> int:
    """The most tokens a multi-token step of ``spec`` plans: MAX_BATCH, or the largest MB (16, 8) whose staged
    input fits in shared memory; 1 where the GPU kernel runs no multi-token step (16-row tiles)."""
    t = tuning.resolve(spec)
    for m in (MAX_BATCH, 16, 8):
        try:
            multi_token(spec, StepShape((1,) * m), t)
            return m
        except ValueError:
            continue
    return 1


def staged_tiles(spec: ModelSpec, t: Tuning, down_parts: int) -> int:
    """Column tiles of the widest input an instruction stages (DOWN_PROJ's a part's where it runs in parts)."""
    kt = lambda k: -(-k // t.tile_k)  # noqa: E731
    return max(kt(spec.hidden_size), kt(spec.q_size),  # ATTN_IN, ROUTER, MLP_IN, EXPERT_IN; O_PROJ
               -(-kt(spec.intermediate_size) // down_parts) if spec.mlp_layers else 1,  # DOWN_PROJ
               kt(spec.moe_intermediate_size) if spec.is_moe else 1)  # EXPERT_DOWN


def query_block(spec: ModelSpec, t: Tuning, qt: int, staging_bytes: int) -> tuple[int, int]:
    """An attention query block's use of the staging buffer (``staging_bytes``; ops/attn_query_block.py): (QBT, the
    K/V block's positions: 32, or 16 where q [QT x GP rows, head_dim] and two stages of 32-position K and V blocks do
    not fit; the most splits a block's combine stages, at most 32: a token's partials [GP, splits, head_dim] fp32
    beside every token's (m, l)). Raises ValueError where neither fits."""
    gp, hd = _pow2(spec.group_size), spec.head_dim
    rows = max(16 * t.num_warps, qt * gp)  # at least one m16 row block a warp
    fits = [b for b in (32, 16) if (-(-rows // b) + 4) * b * hd * 2 <= staging_bytes]
    splits = 1  # at most 32: the combine's lanes go over the splits
    while splits < 32 and gp * 2 * splits * hd * 4 + qt * gp * 2 * splits * 8 <= staging_bytes:
        splits *= 2
    if not fits or gp * splits * hd * 4 + qt * gp * splits * 8 > staging_bytes:
        raise ValueError(f"{spec.name}: a query block of {qt} tokens does not fit the {staging_bytes}-byte staging "
                         "buffer")
    return fits[0], splits


def norm_buffer_bytes(spec: ModelSpec, t: Tuning) -> int:
    """A multi-token step's buffer for a norm's weights (device/matvec_mt.wbuf_rows): the hidden size's 32-column
    chunks, a power of two of them, bf16."""
    return _pow2(-(-spec.hidden_size // t.tile_k) * (t.tile_k // 32)) * 32 * 2


def multi_token(spec: ModelSpec, shape: StepShape, t: Tuning) -> tuple[Tuning, int]:
    """A multi-token step's derived settings: the tuning without cluster pairs, and DOWN_PROJ's column parts: at
    least two (whole rows alone are fewer blocks than the GPU has SMs on every shape: the one-token kernel's halves
    serve the same end), and as few as let the staged input (``token_rows`` rows a column tile, power-of-two tiles)
    fit in shared memory beside the norm buffer and ``MIN_RING_MT`` ring slots. Raises ValueError for a shape the
    GPU kernel does not run."""
    m = shape.num_tokens
    if any(n != 1 for n in shape.seg_lens) or m > MAX_BATCH:
        raise ValueError(f"seg_lens={shape.seg_lens}: the megakernel's GPU kernel runs one token, or 2..{MAX_BATCH} "
                         "one-token segments (a verify block runs as one-token segments: launch/one_token.py)")
    if max(shape.attn_blocks, default=1) > MAX_QUERY_BLOCK:
        raise ValueError(f"attn_blocks={shape.attn_blocks}: an attention query block holds at most "
                         f"{MAX_QUERY_BLOCK} tokens")
    if t.tile_rows != 32 or t.tile_k % 64:
        raise ValueError(f"a multi-token step needs [32, 256]-style tiles (a chunk pair is wgmma's 64-row A), got "
                         f"[{t.tile_rows}, {t.tile_k}] (head_dim {spec.head_dim})")
    if spec.is_moe and m > MAX_MOE_BATCH:
        raise ValueError(f"{spec.name}: a multi-token step of a mixture-of-experts model runs at most "
                         f"{MAX_MOE_BATCH} tokens (got {m}): at 16 the router finisher's registers spill")
    t = dataclasses.replace(t, clusters=False)
    kt = lambda k: -(-k // t.tile_k)  # noqa: E731
    mb = token_rows(m)
    row_bytes, slot = t.tile_k * 2 * mb, t.tile_rows * t.tile_k * 2
    room = SHARED_BYTES - SCRATCH_BYTES - MIN_RING_MT * slot - norm_buffer_bytes(spec, t)
    base = max(kt(spec.hidden_size), kt(spec.q_size))
    for parts in range(min(2, kt(spec.intermediate_size)), kt(spec.intermediate_size) + 1):
        if _pow2(max(base, -(-kt(spec.intermediate_size) // parts))) * row_bytes <= room:
            return t, parts
    raise ValueError(f"{spec.name}: {_pow2(base)} staged column tiles of {mb} tokens do not fit in shared memory "
                     f"beside {MIN_RING_MT} ring slots")


def plan(spec: ModelSpec, num_sms: int, shape: StepShape = StepShape(), page_size: int = 16,
         tuning: Tuning = Tuning(), kv_dtype: torch.dtype = torch.bfloat16, tp: tuple[int, int] = (0, 1)) -> LaunchPlan:
    """``kv_dtype``: the paged cache's element type (``PagedKVCache.layout.dtype``), one of ``KV_DTYPES``; ``tp``:
    (rank, ranks) of tensor parallelism (tensor_parallel.py): the plan is rank ``tp[0]``'s kernel, over its shard of
    ``spec`` (``LaunchPlan.spec``), on ``num_sms`` SMs."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"the megakernel reads a bf16 or an fp8 (e4m3) KV cache, not {kv_dtype}")
    if spec.is_moe and kv_dtype == fp8.FP8:  # neither compiled nor GPU-checked together (tools/check.py's routing
        # checks and fp8 row checks have not run on one model); refused rather than run unchecked
        raise ValueError(f"{spec.name}: the megakernel runs a mixture-of-experts model over a bf16 KV cache only, "
                         "not fp8 yet; use --kv-dtype bf16, or the reference backend for an fp8 KV cache")
    t = tuning.resolve(spec)
    whole, spec = spec, shard_spec(spec, tp[1], t.tile_rows)  # the rank's shard: the model the kernel runs
    check(spec, t)
    m, down_parts, mb = shape.num_tokens, 1, 1
    if m > 1:
        t, down_parts = multi_token(spec, shape, t)
        mb = token_rows(m)
    # one cached K (or V) row: head_dim elements, and for fp8 its bf16 scale (kv/pages.py)
    row_bytes = spec.head_dim * kv_dtype.itemsize + (fp8.SCALE_DTYPE.itemsize if kv_dtype == fp8.FP8 else 0)
    cfg = dataclasses.replace(t.program_config(), kv_row_bytes=row_bytes, max_splits=combine_splits(spec, t), tp=tp)
    if down_parts > 1:
        cfg = dataclasses.replace(cfg, down_parts=down_parts)
    qbt, qt = 0, 1
    if shape.attn_blocks:  # attention's query blocks (ops/attn_query_block.py) stage through the staging buffer.
        # Every layout of blocks in a bucket compiles one kernel: QT the bucket's longest possible block, and (below)
        # SP2 the most splits any layout of the bucket gives a block: a block of several tokens alone, or a
        # single token beside one other block
        qt = _pow2(min(m, MAX_QUERY_BLOCK))
        qbt, splits = query_block(spec, t, qt, _pow2(staged_tiles(spec, t, down_parts)) * t.tile_k * 2 * mb)
        cfg = dataclasses.replace(cfg, max_splits=min(cfg.max_splits, splits))
    program = build_program(whole, shape, num_sms, cfg)
    sp2 = _pow2(program.max_splits)
    if shape.attn_blocks:
        alone = (StepShape((1, 1), shape.context_hint, blocks) for blocks in ((2,), (1, 1)))  # a block; a token
        sp2 = max(sp2, *(_pow2(max(attention_splits(spec, s, num_sms, cfg))) for s in alone))  # beside another
    host_only = sorted({ins.OP for ins in program.instructions()} - set(GPU_OPS) - {Op.NOP})
    if host_only:
        raise ValueError(f"{spec.name}: {', '.join(op.name for op in host_only)} have no device code; the VM runs "
                         "them; use the reference backend")
    down_pairs = program.down_pairs
    widest = staged_tiles(spec, t, program.down_parts)
    gp = _pow2(spec.group_size)
    merge_bytes = t.num_warps * gp * (spec.head_dim + 2) * 4  # ATTN_PARTIAL's warps' states (SMEM_MERGE)
    if m == 1 and gp > 4:  # the warps' states of more than four heads merge through the staging buffer: Triton's
        # own reduction over the warp axis would take its scratch from the ring and spill registers
        widest = max(widest, -(-merge_bytes // (t.tile_k * 2)))
    hbuf_rows = _pow2(widest)
    hbuf_bytes = hbuf_rows * t.tile_k * 2 * mb
    wbuf_bytes = norm_buffer_bytes(spec, t) if m > 1 else 0
    xb = exchange_bytes(spec.head_dim) if program.attn_pairs else 0
    slot = t.tile_rows * t.tile_k * 2
    # every one-token attention split streams its past K/V through the ring, but a multi-token step's over an fp8
    # cache: its slots of e4m3 rows on the tensor cores spill there (the 8B at M = 16: 84 spill stores, 320 with the
    # late rows), so its splits keep requesting each block with its scales (ops/attn_partial._partial)
    kvs, kvbox = kv_ring(spec, t, page_size, kv_dtype) if m == 1 or kv_dtype != fp8.FP8 else (0, 1)
    slot_bytes = slot + kv_scale_bytes(kvs, kv_dtype)  # an fp8 cache's scales travel beside their slot
    # a multi-token MoE step's router finisher reduces [8, E] over the warps, and its scan and layout conversions,
    # through the compiler's scratch: 12 KB more than the dense kernel's 8 (the 30B-A3B's 128 experts: 16.5 KB)
    moe_bytes = 24 * _pow2(spec.num_experts) * 4 if spec.is_moe and m > 1 else 0
    fit = (SHARED_BYTES - hbuf_bytes - wbuf_bytes - SCRATCH_BYTES - xb - moe_bytes) // slot_bytes
    if t.ring > fit:
        raise ValueError(f"ring={t.ring} slots of {slot_bytes} bytes do not fit in shared memory ({fit} do)")
    if fit < 2:
        raise ValueError(f"shared memory holds {fit} ring slots of {slot_bytes} bytes; the ring needs 2")
    ring = t.ring or fit
    smem_merge = merge_bytes <= hbuf_bytes
    words, lens = program.encode()
    if t.quiet >= 0:
        marks = hold_marks(program, t.quiet)
        check_marks(marks)
        words = mark_words(words, marks)
    c = Constants(
        D=spec.hidden_size, HQ=spec.num_heads, HKV=spec.num_kv_heads, HD=spec.head_dim,
        I=spec.intermediate_size, NL=spec.num_layers, PS=page_size, HAS_BIAS=spec.attention_bias,
        QK_NORM=spec.qk_norm, TR=t.tile_rows, TK=t.tile_k, NB=ring, KT_ROWS=hbuf_rows,
        SG=min(hbuf_rows, 4096 // t.tile_k), BT=min(attn_block(spec, kv_dtype, m), kvs or 1 << 30),
        SP2=sp2, GP=gp,
        LOADER_REGS=t.loader_regs, INFLIGHT=t.inflight if t.inflight < ring else 0, QUIET=t.quiet, XB=xb,
        DOWN_PAIRS=down_pairs, SMEM_MERGE=smem_merge, FP8=kv_dtype == fp8.FP8, TRACE=t.trace, NW=t.num_warps,
        ATTN_MMA=attn_ring_mma.applies(kvs, t.num_warps),
        KVS=kvs, KVBOX=kvbox, M=m, QT=qt, QBT=qbt,
        MB=mb, V=spec.vocab_size, E=spec.num_experts, EP2=_pow2(spec.num_experts),
        EP=router_rows(spec, t.tile_rows), S=program.moe_slots, S2=_pow2(program.moe_slots),
        K=spec.num_experts_per_tok, F=spec.moe_intermediate_size, NORM_TOPK=spec.norm_topk_prob, TP=tp[1])
    return LaunchPlan(spec, t, num_sms, page_size, program, words, lens, ring, hbuf_rows, xb, c)
