"""ATTN_IN: one column part of one q, k or v head of one layer, for every token of the step; the head's finisher
(the last part to draw its ticket, or part 0 of a cluster pair) completes it.

Head index convention: 0..Hq-1 query heads, Hq..Hq+Hkv-1 key heads, Hq+Hkv..Hq+2*Hkv-1 value heads.

solve (every part):
    x   [M, D]   residual stream entering the layer (layer 0: the embedding rows weights.embed[tokens])
    h   [M, D]   = RMSNorm(x) * attn_norm                         (rounded to the weight dtype, see common.py)
    qkv_part[part] [M, hd] = h[:, cols] . W[head rows, cols]^T,  cols = tiles.column_part(D, tile_k, part, n_parts)
finish:
    y   [M, hd]  = sum of qkv_part[0..n_parts-1] in part order (+ bias rows, qwen2)
    q/k heads:   y = RMSNorm(y) * q_norm / k_norm  (qwen3, per head)  then RoPE at each token's position
                 (rope.cos_sin, HF rotate_half pairing: element i pairs with i + hd/2)
    v heads:     bias only
    writes: q head -> scratch.q[:, head, :]  [M, hd] fp32;
            k/v head -> cache.k / cache.v [layer, page, kv_head, row, :] in the cache's format (kv/pages.py), with
            page = block_tables[seg(m)][pos_m // page_size], row = pos_m % page_size.
Tiles: the head's hd rows of the qkv matrix, the part's column tiles.

Device (``compute``): RMSNorm(x) staged once for a run of ATTN_IN instructions; each row tile's sums go to the
qkv_part scratch (a ticket: the last part finishes the head from the parts in global memory) or, in a cluster pair,
into both CTAs' exchange slots (device/cluster.py): part 0 waits for part 1's sums and finishes the head, reading
the step-independent finish inputs (inverse frequencies, q/k norm weights, bias) before the exchange's wait. A K/V
row is stored in the cache's format (``store_row``): bf16, or (an fp8 cache) quantised in registers to e4m3 with
its bf16 scale, bit for bit as the host's ``PagedKVCache.store``. A multi-token step's finisher does every token at
once (``_finish_mt``: [tokens, half head] tiles, one round of loads for all the tokens' positions, pages and part
sums; ``store_rows`` quantises each token's row on its own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...kv import fp8
from ...models import rope
from ...models.spec import ModelSpec
from ..device import cluster, layouts, matvec as mv, matvec_mt as mt
from ..device.context import W_A, W_B, W_C, W_D, W_K0, W_K1, W_LAYER
from ..device.sync import counter_wait, ticket_is_last
from ..isa import CLUSTER_PAIR, NO_COUNTER, Instruction, Op, TileSpan, Word
from ..tiles import WeightTiles, column_part, column_tiles
from .common import OpContext, matvec, residual, rms_norm

OP = Op.ATTN_IN


@dataclass(frozen=True)
class AttnIn(Instruction):
    OP: ClassVar[Op] = Op.ATTN_IN
    FIELDS: ClassVar[dict[str, Word]] = {"layer": Word.LAYER, "head": Word.A, "part": Word.B, "n_parts": Word.C,
                                         "ticket": Word.D}
    layer: int = 0
    head: int = 0  # 0..Hq-1 query heads, Hq..Hq+Hkv-1 key heads, then value heads
    part: int = 0  # which of the n_parts column ranges this instruction multiplies
    n_parts: int = 1
    ticket: int = NO_COUNTER  # counter the parts draw tickets from; the last part finishes the head

    @property
    def has_finisher(self) -> bool:
        if self.flags & CLUSTER_PAIR:  # part 0 of a cluster pair finishes the head, part 1 only hands its sums over
            return self.part == 0
        return True

    @property
    def ticket_count(self) -> int:
        return self.n_parts

    def mate_key(self) -> tuple:
        return self.OP, self.layer, self.head, self.n_parts


def span(spec: ModelSpec, wt: WeightTiles, layer: int, head: int, part: int, n_parts: int) -> TileSpan:
    nqkv, hd = spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim
    k0, k1 = column_tiles(spec.hidden_size, wt.tile_k, part, n_parts)
    return wt.span("qkv", (layer * nqkv + head) * hd, hd, k0, k1)


def _head(ctx: OpContext, layer: int, head: int):
    spec, lw = ctx.spec, ctx.weights.layers[layer]
    hq, hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    kind, idx = ("q", head) if head < hq else (("k", head - hq) if head < hq + hkv else ("v", head - hq - hkv))
    w, b = {"q": (lw.wq, lw.bq), "k": (lw.wk, lw.bk), "v": (lw.wv, lw.bv)}[kind]
    return kind, idx, w, b, slice(idx * hd, (idx + 1) * hd)


def solve(ctx: OpContext, ins: AttnIn) -> None:
    spec, lw = ctx.spec, ctx.weights.layers[ins.layer]
    _, _, w, _, rows = _head(ctx, ins.layer, ins.head)
    c0, c1 = column_part(spec.hidden_size, ctx.program.config.tile_k, ins.part, ins.n_parts)
    h = rms_norm(residual(ctx, ins.layer), lw.attn_norm, spec.rms_norm_eps)  # [M, D]
    ctx.scratch.qkv_part[ins.part, :, ins.head] = matvec(h[:, c0:c1], w[rows, c0:c1])  # [M, hd]


def finish_rows(ctx: OpContext, layer: int, head: int, n_parts: int) -> torch.Tensor:
    """y [M, hd] of one head: its n_parts column parts summed in part order (+bias) (+q/k RMSNorm) (+RoPE for q
    and k heads), for every token of the step."""
    spec, lw = ctx.spec, ctx.weights.layers[layer]
    kind, _, _, b, rows = _head(ctx, layer, head)
    y = ctx.scratch.qkv_part[0, :, head]
    for p in range(1, n_parts):
        y = y + ctx.scratch.qkv_part[p, :, head]
    if b is not None:
        y = y + b[rows].float()
    if kind != "v":
        if spec.qk_norm:
            y = rms_norm(y, lw.q_norm if kind == "q" else lw.k_norm, spec.rms_norm_eps)
        cos, sin = rope.cos_sin(spec, ctx.state.positions.long())  # [M, hd/2] each
        y = rope.apply_rope(y[:, None, :], cos, sin)[:, 0, :]
    return y


def finish(ctx: OpContext, ins: AttnIn) -> None:
    kind, idx, _, _, _ = _head(ctx, ins.layer, ins.head)
    y = finish_rows(ctx, ins.layer, ins.head, ins.n_parts)
    if kind == "q":
        ctx.scratch.q[:, idx, :] = y
        return
    pages, slots = kv_slots(ctx, ctx.state.positions.long())
    ctx.cache.store(kind, ins.layer, pages, slots, y, head=idx)  # rounded, or quantised per row (fp8)


def kv_slots(ctx: OpContext, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, rows in page) [M] of each step token's KV slot, through its segment's block table."""
    shape, ps = ctx.program.shape, ctx.cache.layout.page_size
    seg_of = torch.repeat_interleave(torch.arange(len(shape.seg_lens)), torch.tensor(shape.seg_lens))  # [M]
    tables = ctx.state.block_tables.long()  # [S, P]
    return tables[seg_of, positions // ps], positions % ps


# --- device ---------------------------------------------------------------------------------------------------

MAX_PARTS: gl.constexpr = gl.constexpr(8)  # column parts a head may have without cluster pairs (plan.check)


@gluon.jit
def compute(ins, C: gl.constexpr, s, b, sm, it, xn, restage, tid, sig):
    """One ATTN_IN part on the GPU; returns (it, xn, the counter it signals: ``sig``, or -1 for a part that
    finishes nothing)."""
    layer = ins.field(W_LAYER)
    head = ins.field(W_A)
    part = ins.field(W_B)
    n_parts = ins.field(W_C)
    KT_D: gl.constexpr = C.KT_D
    if C.M > 1:
        it, xn, sig = _compute_mt(ins, C, s, b, sm, it, xn, restage, sig, layer, head, part, n_parts)
    else:
        if restage:
            mv.stage_normed(sm.hbuf, b.x, s.emb_row, layer == 0, b.anorm + layer * C.D, C.D, b.eps, KT_D, C)
        if C.XB > 0:
            if xn == 0:  # the mate's exchange barriers exist before this CTA's first remote store
                counter_wait(s.rdy, gl.program_id(0) ^ 1, s.epoch + 1)
        it = _part(sm, it, ins.field(W_K0), ins.field(W_K1), head, part, b.qkvp, xn, C)
        if C.XB > 0:  # a cluster pair: the parts swap sums on chip, part 0 finishes (part 1's word: no signal)
            pre = _finish_inputs(layer, head, b, C)  # requested before the exchange's wait, not after it
            cluster.pair_meet(tid, xn, C.XB, C.HD * 4)
            if part == 0:
                _finish(layer, head, n_parts, s.pos, s.tok_page, b.qkvp + head * C.HD, C.NQKV * C.HD, b.q, b, C, xn,
                        pre)
            xn += 1
        elif ticket_is_last(s.cnt, ins.field(W_D), n_parts, s.epoch):  # the last part finishes the head
            _finish(layer, head, n_parts, s.pos, s.tok_page, b.qkvp + head * C.HD, C.NQKV * C.HD, b.q, b, C, xn,
                    _finish_inputs(layer, head, b, C))
        else:
            sig = -1  # an earlier part: no signal
    return it, xn, sig


@gluon.jit
def _compute_mt(ins, C: gl.constexpr, s, b, sm, it, xn, restage, sig, layer, head, part, n_parts):
    """A multi-token ATTN_IN part (a decode batch: token t is segment t; device/matvec_mt.py): every token's sums
    to qkv_part[part, t, head], the ticket, and the last part finishes the head for each token at its own position
    and cache page (its segment's block table). No cluster pairs (plan.py)."""
    KT_D: gl.constexpr = C.KT_D
    HD: gl.constexpr = C.HD
    if restage:
        mt.stage_normed(sm.hbuf, sm.wbuf, b.x16, b.emb, s.toks, layer == 0, b.anorm + layer * C.D, C.D, b.eps, KT_D,
                        C)
    out = b.qkvp + part * (C.M * C.NQKV * HD) + head * HD
    ROW_TILES: gl.constexpr = HD // C.TR
    for r in gl.static_range(ROW_TILES):
        rows, t = mt.tile_index(r * C.TR, C)
        acc, it = mt.dot_tile(sm, it, ins.field(W_K0), ins.field(W_K1), 0, C)
        gl.store(out + t * (C.NQKV * HD) + rows, acc, mask=(t < C.M) & (rows >= 0))
    if ticket_is_last(s.cnt, ins.field(W_D), n_parts, s.epoch):  # the last part finishes the head, every token
        _finish_mt(layer, head, n_parts, s, b, C)
    else:
        sig = -1
    return it, xn, sig


@gluon.jit
def _finish_mt(layer, head, n_parts, s, b, C: gl.constexpr):
    """The head's finisher for every token of a multi-token step, as ``_finish`` does for one, a group of TG tokens
    at a time: the tokens' halves a = y[:, :HD/2] and b = y[:, HD/2:] as [TG, HD/2] tiles (tokens over the warps,
    the half head over the lanes), so a group's positions, block-table pages and part sums are each one round of
    loads, not one round trip after another per token (TG = 8 rows keeps the 8B's tiles within the registers)."""
    TG: gl.constexpr = min(C.MB, 8)
    for t0 in range(0, C.M, TG):
        _finish_group(layer, head, n_parts, t0, s, b, TG, C)


@gluon.jit
def _finish_group(layer, head, n_parts, t0, s, b, TG: gl.constexpr, C: gl.constexpr):
    """``_finish_mt`` for tokens t0 .. t0 + TG - 1 (those below M)."""
    HD: gl.constexpr = C.HD
    HH: gl.constexpr = HD // 2
    L2: gl.constexpr = gl.BlockedLayout([1, max(1, HH // 32)], [1, 32], [C.NW, 1], [1, 0])
    t = t0 + gl.expand_dims(gl.arange(0, TG, gl.SliceLayout(1, L2)), 1)  # [TG, 1] token
    j = gl.expand_dims(gl.arange(0, HH, gl.SliceLayout(0, L2)), 0)  # [1, HH] element of a half head
    ok = (t < C.M) & (j >= 0)  # [TG, HH]
    tok = t < C.M
    pos = gl.load(s.poss + t, mask=tok, other=0)  # [TG, 1]
    inv_f = gl.load(b.invf + j)  # step-independent loads in the same round as the positions
    # a k or v head's cache pages, requested now: in flight with the parts' sums below
    page = gl.load(s.bt + t * s.maxp + pos // C.PS, mask=tok & (head >= C.HQ), other=0)
    src = b.qkvp + (t * C.NQKV + head) * HD
    PSTRIDE: gl.constexpr = C.M * C.NQKV * HD
    a = gl.load(src + j, mask=ok, other=0.0, cache_modifier=".cg")
    bh = gl.load(src + HH + j, mask=ok, other=0.0, cache_modifier=".cg")
    for p in range(1, n_parts):  # one round of loads a part, all the tokens in it (unrolled as _finish does, the
        # parts. [TG, HD/2] tiles would spill the 8B's registers)
        a += gl.load(src + p * PSTRIDE + j, mask=ok, other=0.0, cache_modifier=".cg")
        bh += gl.load(src + p * PSTRIDE + HH + j, mask=ok, other=0.0, cache_modifier=".cg")
    if C.HAS_BIAS:
        bb = b.bias + (layer * C.NQKV + head) * HD
        a += gl.load(bb + j).to(gl.float32)
        bh += gl.load(bb + HH + j).to(gl.float32)
    if head < C.HQ + C.HKV:  # q and k heads: optional per-head RMSNorm, then RoPE at each token's position
        if C.QK_NORM:
            if head < C.HQ:
                nw = b.qn + layer * HD
            else:
                nw = b.kn + layer * HD
            rs = gl.expand_dims(gl.rsqrt((gl.sum(a * a, axis=1) + gl.sum(bh * bh, axis=1)) / HD + b.eps), 1)
            a = (a * rs).to(gl.bfloat16).to(gl.float32) * gl.load(nw + j).to(gl.float32)
            bh = (bh * rs).to(gl.bfloat16).to(gl.float32) * gl.load(nw + HH + j).to(gl.float32)
        a, bh = _rope(a, bh, pos, inv_f)
    if head < C.HQ:
        qb = b.q + t * (C.HQ * HD) + head * HD
        gl.store(qb + j, a, mask=ok)
        gl.store(qb + HH + j, bh, mask=ok)
    else:
        dst, scale_dst = _kv_row(layer, head, page, pos, b, C)  # [TG, 1] each
        store_rows(dst, scale_dst, a, bh, j, ok, C)


@gluon.jit
def _part(sm, it, k0, k1, head, part, qkvp_ptr, xn, C: gl.constexpr):
    """qkv_part[part, head] = W[head rows, column tiles k0..k1) . h, fp32 to global scratch (the head's finisher may
    run on another SM), or (a cluster pair) into exchange ``xn``'s slot of this CTA and of its mate."""
    OWN: gl.constexpr = layouts.thread(C)  # element e: lane e % 32 of every warp
    offs_r = gl.arange(0, C.TR, gl.SliceLayout(1, layouts.tile(C)))
    out = qkvp_ptr + (part * C.NQKV + head) * C.HD
    ROW_TILES: gl.constexpr = C.HD // C.TR
    for r in gl.static_range(ROW_TILES):
        acc, it = mv.dot_tile(sm, it, k0, k1, C)
        if C.XB > 0:
            cluster.pair_store(gl.convert_layout(acc, OWN), r * C.TR + gl.arange(0, C.TR, OWN), part, xn, C.XB,
                               C.HD)
        else:
            gl.store(out + r * C.TR + offs_r, acc)
    return it


@gluon.jit
def _half_index(C: gl.constexpr):
    """[HD/2TR, TR] indices within a half head (RoPE pairs element i with i + HD/2)."""
    E2: gl.constexpr = layouts.half_head(C)
    HH: gl.constexpr = C.HD // (2 * C.TR)
    ti = gl.arange(0, HH, gl.SliceLayout(1, E2))
    ri = gl.arange(0, C.TR, gl.SliceLayout(0, E2))
    return gl.expand_dims(ti, 1) * C.TR + gl.expand_dims(ri, 0)


@gluon.jit
def _finish_inputs(layer, head, b, C: gl.constexpr):
    """What the finish reads that does not depend on this step, as half-head tiles: (inverse frequencies, q/k norm
    weights a and b, bias a and b; zeros where the model has none)."""
    i = _half_index(C)
    inv_f = gl.load(b.invf + i)
    nw_a = inv_f * 0.0
    nw_b = inv_f * 0.0
    bias_a = inv_f * 0.0
    bias_b = inv_f * 0.0
    if head < C.HQ:
        nw = b.qn + layer * C.HD
    else:
        nw = b.kn + layer * C.HD
    if C.QK_NORM:
        nw_a = gl.load(nw + i).to(gl.float32)
        nw_b = gl.load(nw + C.HD // 2 + i).to(gl.float32)
    if C.HAS_BIAS:
        bb = b.bias + (layer * C.NQKV + head) * C.HD
        bias_a = gl.load(bb + i).to(gl.float32)
        bias_b = gl.load(bb + C.HD // 2 + i).to(gl.float32)
    return inv_f, nw_a, nw_b, bias_a, bias_b


@gluon.jit
def _finish(layer, head, n_parts, pos, page, src, PSTRIDE: gl.constexpr, q_ptr, b, C: gl.constexpr, xn, pre):
    """The head's finisher for the token at position ``pos`` (its cache page ``page``): y = sum of the parts in part
    order (part p's sums at ``src + p * PSTRIDE``) (+bias) (+RMSNorm) (+RoPE), then store: q heads to the token's
    q scratch ``q_ptr``, k/v heads into the token's paged cache row (``store_row``: bf16, or e4m3 with its scale).
    The halves a = y[:HD/2] and b = y[HD/2:] are held as [HD/2TR, TR] tiles. A cluster pair's sums come from
    exchange ``xn``'s slot."""
    HD: gl.constexpr = C.HD
    i = _half_index(C)
    inv_f, nw_a, nw_b, bias_a, bias_b = pre
    if C.XB > 0:  # both parts' sums are in this CTA's exchange slot, part order
        a = cluster.pair_load(i, 0, xn, C.XB, HD) + cluster.pair_load(i, 1, xn, C.XB, HD)
        bh = cluster.pair_load(HD // 2 + i, 0, xn, C.XB, HD) + cluster.pair_load(HD // 2 + i, 1, xn, C.XB, HD)
    else:
        a = gl.load(src + i, cache_modifier=".cg")
        bh = gl.load(src + HD // 2 + i, cache_modifier=".cg")
        # the parts unrolled and masked, so every part's loads are in flight together (a loop over n_parts would
        # wait for each part's round trip before issuing the next one's loads)
        for p in gl.static_range(1, MAX_PARTS):
            mp = i * 0 + p < n_parts
            a += gl.load(src + p * PSTRIDE + i, mask=mp, other=0.0, cache_modifier=".cg")
            bh += gl.load(src + p * PSTRIDE + HD // 2 + i, mask=mp, other=0.0, cache_modifier=".cg")
    if C.HAS_BIAS:
        a += bias_a
        bh += bias_b
    if head < C.HQ + C.HKV:  # q and k heads: optional per-head RMSNorm, then RoPE
        if C.QK_NORM:
            rs = gl.rsqrt((gl.sum(gl.sum(a * a, axis=1), axis=0) + gl.sum(gl.sum(bh * bh, axis=1), axis=0)) / HD
                          + b.eps)
            a = (a * rs).to(gl.bfloat16).to(gl.float32) * nw_a
            bh = (bh * rs).to(gl.bfloat16).to(gl.float32) * nw_b
        a, bh = _rope(a, bh, pos, inv_f)
    if head < C.HQ:
        qb = q_ptr + head * HD
        gl.store(qb + i, a)
        gl.store(qb + HD // 2 + i, bh)
    else:
        dst, scale_dst = _kv_row(layer, head, page, pos, b, C)
        store_row(dst, scale_dst, a, bh, i, C)


@gluon.jit
def _rope(a, bh, pos, inv_f):
    """RoPE at position(s) ``pos`` of the halves a = y[:HD/2], bh = y[HD/2:] (HF's rotate-half pairing: element i
    with i + HD/2; ``inv_f`` the inverse frequencies in the halves' layout), in fp32."""
    ang = pos.to(gl.float32) * inv_f
    c = gl.cos(ang)
    sn = gl.sin(ang)
    return a * c - bh * sn, bh * c + a * sn


@gluon.jit
def _kv_row(layer, head, page, pos, b, C: gl.constexpr):
    """(the row's first element, its scale) in the cache for k or v head ``head`` at position(s) ``pos`` on cache
    page(s) ``page``: the K pool for k heads, the V pool for v heads. The element offset is int64: a pool passes
    2^31 elements at long contexts (the 8B's 32 layers at 128k)."""
    kvh = (head - C.HQ) % C.HKV
    row = ((layer * b.num_pages + page) * C.HKV + kvh) * C.PS + pos % C.PS
    if head < C.HQ + C.HKV:
        cache = b.kc
        scales = b.ksc
    else:
        cache = b.vc
        scales = b.vsc
    return cache + row.to(gl.int64) * C.HD, scales + row


E4M3_MAX: gl.constexpr = gl.constexpr(fp8.E4M3_MAX)
MIN_SCALE: gl.constexpr = gl.constexpr(2.0 ** -126)  # kv/fp8.py's floor on a nonzero row's scale


@gluon.jit
def store_row(dst, scale_dst, a, bh, i, C: gl.constexpr):
    """One K or V row into the cache: halves a = y[:HD/2], bh = y[HD/2:] ([HD/2TR, TR] fp32, ``i`` their indices)
    to ``dst`` [HD] as bf16, or (C.FP8) quantised exactly as kv/fp8.py's ``quantize``: scale = bf16(amax / 448)
    (1 where amax == 0, at least 2^-126), q = e4m3(clamp(y / scale, -448, 448)), its scale to ``scale_dst``. The
    divisions round to nearest (div_rn, not the approximate division '/' compiles to) and the conversions round to
    nearest even, as torch's do, so the bytes equal the host's ``PagedKVCache.store`` of the same row."""
    HD: gl.constexpr = C.HD
    if C.FP8:
        amax = gl.maximum(gl.max(gl.max(gl.abs(a), axis=1), axis=0), gl.max(gl.max(gl.abs(bh), axis=1), axis=0))
        sc = gl.where(amax > 0.0, gl.maximum(gl.div_rn(amax, E4M3_MAX), MIN_SCALE), 1.0)
        sc = sc.to(gl.bfloat16).to(gl.float32)  # the stored bf16 scale, which the division uses
        qa = gl.minimum(gl.maximum(gl.div_rn(a, sc), -E4M3_MAX), E4M3_MAX)
        qb = gl.minimum(gl.maximum(gl.div_rn(bh, sc), -E4M3_MAX), E4M3_MAX)
        gl.store(dst + i, qa.to(gl.float8e4nv))
        gl.store(dst + HD // 2 + i, qb.to(gl.float8e4nv))
        gl.store(scale_dst + i * 0, gl.where(i >= 0, sc, 0.0).to(gl.bfloat16), mask=i == 0)  # one thread
    else:
        gl.store(dst + i, a.to(gl.bfloat16))
        gl.store(dst + HD // 2 + i, bh.to(gl.bfloat16))


@gluon.jit
def store_rows(dst, scale_dst, a, bh, j, ok, C: gl.constexpr):
    """``store_row`` for a group of a multi-token step's tokens: halves a, bh [TG, HD/2] (a token a row, ``j``
    [1, HD/2] the element index), each token's row at ``dst`` [TG, 1] and (C.FP8) its scale at ``scale_dst``
    [TG, 1], the tokens where ``ok`` [TG, HD/2] holds; an fp8 row's scale from its own amax, the same bytes as
    ``store_row`` and the host's ``PagedKVCache.store``."""
    HH: gl.constexpr = C.HD // 2
    if C.FP8:
        amax = gl.maximum(gl.max(gl.abs(a), axis=1), gl.max(gl.abs(bh), axis=1))  # [TG]
        sc = gl.where(amax > 0.0, gl.maximum(gl.div_rn(amax, E4M3_MAX), MIN_SCALE), 1.0)
        sc = gl.expand_dims(sc.to(gl.bfloat16).to(gl.float32), 1) + a * 0.0  # [TG, HD/2], each row its scale
        qa = gl.minimum(gl.maximum(gl.div_rn(a, sc), -E4M3_MAX), E4M3_MAX)
        qb = gl.minimum(gl.maximum(gl.div_rn(bh, sc), -E4M3_MAX), E4M3_MAX)
        gl.store(dst + j, qa.to(gl.float8e4nv), mask=ok)
        gl.store(dst + HH + j, qb.to(gl.float8e4nv), mask=ok)
        gl.store(scale_dst + j * 0, sc.to(gl.bfloat16), mask=ok & (j == 0))  # one lane a token
    else:
        gl.store(dst + j, a.to(gl.bfloat16), mask=ok)
        gl.store(dst + HH + j, bh.to(gl.bfloat16), mask=ok)
