"""mimw's paged prefill attention: FlashAttention-2's forward (tiled, online softmax, tensor-core dots, no score
matrix in memory) reading K/V straight from the paged cache through the block tables.

One program per (query head, block of ``block_m`` query rows of one piece). Its queries sit at positions
start+m0 .. start+m0+block_m-1 of their sequence and see keys 0 .. their own position, so the key loop has two
parts: keys [0, start+m0) that every row sees (tiles with no mask at all), then the diagonal tiles up to
min(ctx, start+m0+block_m) with the causal mask. Grid axis 0 is the query head: the programs launched together are
one query block's heads, so a KV head's tiles are read from HBM once and served to its GQA group from L2. The work
list (``PrefillBatch.work``) puts the blocks with the most keys first, so the longest programs never form the tail.
A pass of short pieces (decode tokens, verify blocks: ``query_rows``) would leave most of such a block's rows empty
and run one program per query head over the whole context; there a program takes a KV head's whole GQA group
instead (rows = the group's heads x the pieces' tokens), so the tile's rows are real queries and the group's K/V
tiles are loaded once.

A key tile of ``block_n`` positions spans block_n / page_size pages: each key's page comes from the block table, its
row is position % page_size, and (page, head) is a contiguous [page_size, hd] tile of the [P, Hkv, PS, hd] layer,
so every key row is one contiguous hd-element read. ``_kv_rows`` turns a tile's positions into cache rows (the
block table read once a tile, shared by K, V and their scales) and ``_load_kv`` is the one place that reads the
cache: with ``SCALED`` (an fp8 cache, ``mimw.kv.pages``) it also reads each row's bf16 scale from the [P, Hkv, PS]
scale tensor at the same (page, head, row) and dequantises before the dot as ``float(q) * float(scale)`` (exact in
fp32, as ``fp8.dequantize``), rounded to bf16 for the tensor cores; so an fp8 cache changes the loader, not the
kernel.

Tiles (``AttentionTiles.for_head_dim``): the fastest measured on the H200 (``mimw bench prefill``'s attention
sweep, bench/NOTES.md): [128, 128, 4 warps] at hd 64 (379 TFLOP/s, against 280 for [128, 128, 8 warps]) and
[256, 64, 8 warps] at hd 128 (456, against 346 for [128, 64, 8 warps]), for passes with a piece longer than 128
rows; shorter passes (decode batches, verify blocks) keep block_m 128. Both hold their fp32 accumulator and score
tile in block_m * (hd + block_n) / (32 * num_warps) = 192 registers a thread, the tiles they replace in 96.

Scores are scaled by log2(e)/sqrt(hd) and exponentiated with exp2, the max taken on the unscaled scores so that
scale and shift are one FMA a score (not a multiply and a subtract); the running max, sum and accumulator are fp32;
the probabilities enter the second dot in bf16 (as FlashAttention does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .batch import PrefillBatch


@dataclass(frozen=True)
class AttentionTiles:
    """Tile shape and launch options of the kernel (measured on the H200 by ``mimw bench prefill``)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3

    @classmethod
    def for_head_dim(cls, head_dim: int, rows: int | None = None) -> "AttentionTiles":
        """The measured-best tiles for prompt chunks (module docstring); for a pass whose longest piece has at most
        128 query rows (decode batches, verify blocks: ``rows``), block_m 128, the tiles the megakernel backend's
        decode-batch routing was measured with (a 256-row block would compute 256 rows for one)."""
        short = rows is not None and rows <= 128
        if head_dim <= 64:
            return cls(128, 128, 8, 3) if short else cls(128, 128, 4, 3)
        return cls(128, 64, 8, 3) if short else cls(256, 64, 8, 3)

    def __post_init__(self) -> None:
        for f in ("block_m", "block_n"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{f} must be a power of two >= 16, got {v}")


@triton.jit
def _kv_rows(bt, offs_n, in_ctx, kvh, HKV: tl.constexpr, PS: tl.constexpr, MASKED: tl.constexpr):
    """[BLOCK_N] int64 rows, in the layer seen as [P * Hkv * PS, hd], of KV head ``kvh`` at positions offs_n: (page
    * Hkv + kvh) * PS + position % PS. K, V and (fp8) their scales [P, Hkv, PS] share them, so the block table is
    read once a tile. With MASKED, positions outside ``in_ctx`` map into page 0 (never read: ``_load_kv`` masks
    them)."""
    if MASKED:
        page = tl.load(bt + offs_n // PS, mask=in_ctx, other=0).to(tl.int64)
    else:
        page = tl.load(bt + offs_n // PS).to(tl.int64)
    return (page * HKV + kvh) * PS + offs_n % PS


@triton.jit
def _load_kv(base, scale, rows, in_ctx, d, HD: tl.constexpr, MASKED: tl.constexpr, SCALED: tl.constexpr):
    """[BLOCK_N, HD] bf16: the cache rows ``rows`` (with MASKED, rows outside ``in_ctx`` read as 0; without, every
    row is inside the sequence and no load is predicated); with SCALED, fp8 rows times their own scales (``scale``:
    the layer's [P, Hkv, PS] bf16 scales, indexed by the same rows)."""
    ptrs = base + (rows * HD)[:, None] + d[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=in_ctx[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    if SCALED:
        if MASKED:  # rows outside the sequence get scale 1: finite, and their scores are masked anyway
            s = tl.load(scale + rows, mask=in_ctx, other=1.0)
        else:
            s = tl.load(scale + rows)
        x = (x.to(tl.float32) * s.to(tl.float32)[:, None]).to(tl.bfloat16)
    return x


@triton.jit
def _attend_tile(acc, l_i, m_i, q, q_pos, n0, ctx, K, V, KS, VS, bt, kvh, d, qk_scale,
                 HKV: tl.constexpr, PS: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, SCALED: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_ctx = offs_n < ctx
    rows = _kv_rows(bt, offs_n, in_ctx, kvh, HKV, PS, MASKED)
    k = _load_kv(K, KS, rows, in_ctx, d, HD, MASKED, SCALED)
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32, unscaled
    if MASKED:
        # the first tile a row meets always holds key 0, which it sees: its running max is finite from then on
        qk = tl.where((offs_n[None, :] <= q_pos[:, None]) & in_ctx[None, :], qk, float("-inf"))
    # the scale (> 0) commutes with the max, so each score costs one FMA (scale and shift) before its exp2
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv(V, VS, rows, in_ctx, d, HD, MASKED, SCALED)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _paged_prefill_kernel(Q, O, K, V, KS, VS, BT, Q_START, SEQ_START, SEQ_CTX, WORK,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, qk_scale,
                          GROUP: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, PS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr,
                          HP: tl.constexpr):
    """HP = 1: a program is one query head's BLOCK_M rows. HP > 1 (a power of two >= GROUP): a program is one KV
    head's GROUP query heads x BLOCK_M / HP rows (row r: head r // (BLOCK_M / HP) of the group, token
    r % (BLOCK_M / HP); heads past GROUP masked), so short pieces fill the tile and K/V are read once a group."""
    BLOCK_T: tl.constexpr = BLOCK_M // HP
    hx = tl.program_id(0)
    w = tl.program_id(1)
    seg = tl.load(WORK + 2 * w)
    m0 = tl.load(WORK + 2 * w + 1)
    row0 = tl.load(Q_START + seg)
    start = tl.load(SEQ_START + seg)
    ctx = tl.load(SEQ_CTX + seg)
    bt = BT + seg.to(tl.int64) * stride_bt

    r = tl.arange(0, BLOCK_M)
    offs_m = m0 + r % BLOCK_T
    if HP == 1:
        kvh = hx // GROUP
        heads = hx + r * 0
        valid = offs_m < ctx - start
    else:
        kvh = hx
        g = r // BLOCK_T
        heads = hx * GROUP + g
        valid = (offs_m < ctx - start) & (g < GROUP)
    rows = (row0 + offs_m).to(tl.int64)
    d = tl.arange(0, HD)
    q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=valid[:, None],
                other=0.0)
    q_pos = start + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    full_end = ((start + m0) // BLOCK_N) * BLOCK_N  # whole tiles below the block's first query
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, n0, ctx, K, V, KS, VS, bt, kvh, d, qk_scale,
                                     HKV, PS, HD, BLOCK_N, False, SCALED)
    hi = tl.minimum(ctx, start + m0 + BLOCK_T)
    for n0 in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, n0, ctx, K, V, KS, VS, bt, kvh, d, qk_scale,
                                     HKV, PS, HD, BLOCK_N, True, SCALED)
    o = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(O.dtype.element_ty),
             mask=valid[:, None])


def paged_prefill_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, batch: PrefillBatch,
                            tiles: AttentionTiles | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, hd] bf16 (rows of ``batch``); k_layer, v_layer [P, Hkv, PS, hd] (bf16, or fp8 e4m3 with their
    rows' scales ``k_scale``, ``v_scale`` [P, Hkv, PS] bf16: ``mimw.kv.pages``) -> o [T, Hq, hd] in q's dtype."""
    t, hq, hd = q.shape
    _, hkv, ps, _ = k_layer.shape
    tiles = tiles or AttentionTiles.for_head_dim(hd, max(p.length for p in batch.pieces))
    if q.stride(2) != 1 or not (k_layer.is_contiguous() and v_layer.is_contiguous()):
        raise ValueError("paged_prefill_attention needs q with contiguous heads and contiguous cache layers")
    if hd & (hd - 1):
        raise ValueError(f"head_dim must be a power of two, got {hd}")
    scaled = k_scale is not None
    if scaled != (v_scale is not None):
        raise ValueError("k_scale and v_scale go together")
    if not scaled and k_layer.dtype != q.dtype:
        raise ValueError(f"an unscaled cache must hold q's dtype ({q.dtype}), not {k_layer.dtype}")
    if scaled and any(x.shape != k_layer.shape[:-1] or not x.is_contiguous() for x in (k_scale, v_scale)):
        raise ValueError(f"k_scale and v_scale must be contiguous, one per (page, head, row): "
                         f"{tuple(k_layer.shape[:-1])}, got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    o = torch.empty_like(q)
    hp, block_m = query_rows(hq // hkv, max(p.length for p in batch.pieces), tiles.block_m)
    work = batch.work(block_m // hp)
    ks = k_scale if scaled else k_layer  # unread without SCALED
    vs = v_scale if scaled else v_layer
    _paged_prefill_kernel[(hkv if hp > 1 else hq, work.shape[0])](
        q, o, k_layer, v_layer, ks, vs, batch.block_tables, batch.q_start, batch.seq_start, batch.seq_ctx, work,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), batch.block_tables.stride(0),
        math.log2(math.e) / math.sqrt(hd),
        GROUP=hq // hkv, HKV=hkv, HD=hd, PS=ps, BLOCK_M=block_m, BLOCK_N=tiles.block_n, SCALED=scaled, HP=hp,
        num_warps=tiles.num_warps if block_m == tiles.block_m else 4, num_stages=tiles.num_stages)
    return o


MIN_ROWS = 16  # the smallest M of a tensor-core dot


def query_rows(group: int, max_len: int, block_m: int) -> tuple[int, int]:
    """(HP, BLOCK_M) for a pass whose longest piece has ``max_len`` query tokens: pieces that fill a query block
    keep one head a program (HP = 1, ``block_m`` rows); shorter ones (decode tokens, verify blocks) put a KV head's
    GQA group in one program (HP = the group rounded up to a power of two; rows = HP x the pieces' tokens rounded up
    to a power of two, at least MIN_ROWS), so the tile's rows are real queries and each K/V tile is read once for the
    group instead of once per query head."""
    hp = 1 << (group - 1).bit_length()
    t = 1 << (max_len - 1).bit_length()
    if group == 1 or hp * t > block_m:
        return 1, block_m
    return hp, max(MIN_ROWS, hp * t)


class PagedAttention:
    """``paged_prefill_attention`` with fixed tiles, planned per pass (the work list is built once per pass)."""

    def __init__(self, tiles: AttentionTiles | None = None):
        self.tiles = tiles

    def plan(self, batch: PrefillBatch):
        def run(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
            return paged_prefill_attention(q, k_layer, v_layer, batch, self.tiles, k_scale, v_scale)

        return run
