"""The persistent megakernel: one CTA per SM runs its queue of the step program (``megakernel.program``).

Roles (``gl.warp_specialize``):
  compute (default partition, ``num_warps`` warps): for each instruction, wait on its dependency counter
      (acquire), stage its input vector in shared memory, consume weight tiles from the ring, run the epilogue,
      store, and signal its counter (release).
  loader (1 warp, small register budget): walks the SAME queue and streams every weight tile of every matvec
      instruction with TMA into the ring. It never waits on a counter, so it prefetches the next instructions'
      weights (next layer included) while compute waits for dependencies: the ring is the only bound.
With cluster pairs (``XB``, KernelConfig.cluster_qkv) the CTAs run in clusters of two and ATTN_IN's two parts of a
head, on the two CTAs of a cluster, swap their sums through distributed shared memory (gpu/cluster.py) instead of
a ticket (``XD``, KernelConfig.cluster_down: DOWN_PROJ's column halves of a row block too; ``XDS``,
down_half_stage: a half stages only its own columns; ``XDC``, half_hbuf: from the staging buffer's first row, the
buffer sized for the halves). With ``WREL`` (KernelConfig.warp_release) each compute warp releases a ring slot on
its own (orchestration.warp_release); with ``HCNT`` (hold_count) the release hold counts releases in a shared-memory
word instead of an mbarrier's phases; with ``HMARK`` (hold_marks, the default) compute announces only the releases
the loader holds for, as marked on the words by the host (gpu/hold.py); ``ROW1`` (attn_row): the attention's step
row as a one-position block. At the end each CTA adds 1 to the DONE counter; the CTA that completes it bumps EPOCH,
which moves every counter's step-numbered target for the next launch (no reset kernel, CUDA-graph friendly).

Instruction words are fetched with one vector load and unpacked with masked reductions; opcode and field
positions are constexprs taken from ``megakernel.isa`` (the single source of truth).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .. import isa
from . import attention, cluster, matvec, versioned
from .orchestration import (TRACE_STAMPS, counter_signal, counter_wait, globaltimer, globaltimer_after,
                            hold_count_add, hold_count_init, producer_weight_rows, ring_init, ticket_is_last,
                            warp_ring_init)

_C = isa.kernel_constants()
NWORDS: gl.constexpr = gl.constexpr(_C["NWORDS"])
W_OP: gl.constexpr = gl.constexpr(_C["W_OP"])
W_LAYER: gl.constexpr = gl.constexpr(_C["W_LAYER"])
W_A: gl.constexpr = gl.constexpr(_C["W_A"])
W_B: gl.constexpr = gl.constexpr(_C["W_B"])
W_C: gl.constexpr = gl.constexpr(_C["W_C"])
W_D: gl.constexpr = gl.constexpr(_C["W_D"])
W_WAIT: gl.constexpr = gl.constexpr(_C["W_WAIT"])
W_WAIT_COUNT: gl.constexpr = gl.constexpr(_C["W_WAIT_COUNT"])
W_SIGNAL: gl.constexpr = gl.constexpr(_C["W_SIGNAL"])
W_E: gl.constexpr = gl.constexpr(_C["W_E"])
W_F: gl.constexpr = gl.constexpr(_C["W_F"])
W_G: gl.constexpr = gl.constexpr(_C["W_G"])
W_SIGNAL_N: gl.constexpr = gl.constexpr(_C["W_SIGNAL_N"])
W_FLAGS: gl.constexpr = gl.constexpr(_C["W_FLAGS"])
HOLD_ARRIVE: gl.constexpr = gl.constexpr(_C["HOLD_ARRIVE"])
HOLD_WAIT: gl.constexpr = gl.constexpr(_C["HOLD_WAIT"])
OP_ATTN_IN: gl.constexpr = gl.constexpr(_C["OP_ATTN_IN"])
OP_ATTN_PARTIAL: gl.constexpr = gl.constexpr(_C["OP_ATTN_PARTIAL"])
OP_ATTN_REDUCE: gl.constexpr = gl.constexpr(_C["OP_ATTN_REDUCE"])
OP_O_PROJ: gl.constexpr = gl.constexpr(_C["OP_O_PROJ"])
OP_MLP_IN: gl.constexpr = gl.constexpr(_C["OP_MLP_IN"])
OP_DOWN_PROJ: gl.constexpr = gl.constexpr(_C["OP_DOWN_PROJ"])
OP_LM_HEAD: gl.constexpr = gl.constexpr(_C["OP_LM_HEAD"])
STREAMING: gl.constexpr = gl.constexpr(_C["STREAMING"])
WP2: gl.constexpr = gl.constexpr(16)  # NWORDS rounded up to a power of two for the vector fetch


@gluon.jit
def _field(w, offs, k: gl.constexpr):
    return gl.sum(gl.where(offs == k, w, 0), axis=0)


@gluon.jit
def _streams(op):
    """Whether instruction ``op`` streams weight tiles through the ring: isa.STREAMING_OPS, the loader's (a test
    holds the two lists equal)."""
    return (op == OP_ATTN_IN) | (op == OP_O_PROJ) | (op == OP_MLP_IN) | (op == OP_DOWN_PROJ) | (op == OP_LM_HEAD)


@gluon.jit
def _announces(w, offs, op, HMARK: gl.constexpr):
    """Whether compute announces this instruction's release on the release hold (and the loader counts it): with
    HMARK where the host marked it (isa.HOLD_ARRIVE, gpu/hold.py), else every signalling streaming instruction."""
    if HMARK:
        return (_field(w, offs, W_FLAGS) & HOLD_ARRIVE) != 0
    else:
        return _streams(op) & (_field(w, offs, W_SIGNAL) >= 0)


@gluon.jit
def _part_tiles(part, KT, n_parts):
    """Column tiles [k0, k1) of part ``part`` of ``n_parts`` over KT column tiles (program.column_part): ATTN_IN's
    column parts, O_PROJ's (KernelConfig.o_parts)."""
    return part * KT // n_parts, (part + 1) * KT // n_parts


@gluon.jit
def _words(prog_ptr, MAXLEN, i, offs, n):
    """Instruction i of this CTA's queue (i < n; zeros past the queue's end): all NWORDS words in one vector load."""
    return gl.load(prog_ptr + (gl.program_id(0) * MAXLEN + i) * NWORDS + offs, mask=(offs < NWORDS) & (i < n),
                   other=0)


@gluon.jit
def _fetch(prog_ptr, MAXLEN, i, offs):
    """Instruction i of this CTA's queue: all NWORDS words in one vector load; (words, op, layer, A, B)."""
    w = _words(prog_ptr, MAXLEN, i, offs, i + 1)
    return w, _field(w, offs, W_OP), _field(w, offs, W_LAYER), _field(w, offs, W_A), _field(w, offs, W_B)


@gluon.jit
def _loader(prog_ptr, qlen_ptr, MAXLEN, d_qkv, d_o, d_gu, d_down, d_lm, bufs, empty, ready, rel, tiles_ptr,
            MAXT, D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr, I: gl.constexpr,
            TR: gl.constexpr, TK: gl.constexpr, TILED: gl.constexpr, INFLIGHT: gl.constexpr, QUIET: gl.constexpr,
            QUIET_OPS: gl.constexpr, O_PARTS: gl.constexpr, DEEP: gl.constexpr, DEEP_OPS: gl.constexpr,
            WOFF: gl.constexpr, XD: gl.constexpr, TRACE_TILES: gl.constexpr, HOFF: gl.constexpr,
            HMARK: gl.constexpr):
    WL: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    NQKV: gl.constexpr = HQ + 2 * HKV
    KT_D: gl.constexpr = (D + TK - 1) // TK
    KT_Q: gl.constexpr = (HQ * HD + TK - 1) // TK
    KT_I: gl.constexpr = (I + TK - 1) // TK
    pid = gl.program_id(0)
    n = gl.load(qlen_ptr + pid)
    offs = gl.arange(0, WP2, WL)
    if TRACE_TILES:  # [want slot, slot free = TMA issued, compute wants data, has data] per tile (trace.py)
        stamps = tiles_ptr + pid * MAXT * 4
    else:
        stamps = None
    if QUIET >= 0:  # the release hold (KernelConfig.quiet, orchestration.py): compute arrives on ``rel`` after the
        # release of every streaming instruction whose word signals; this loader counts them (``released``) and
        # remembers the last one's wait
        hold = rel
    else:
        hold = None
    released = 0
    prev_wait = -2
    it = 0
    for i in range(n):
        w, op, layer, a, b = _fetch(prog_ptr, MAXLEN, i, offs)
        hold_at = -1  # a streaming instruction of a new stage: its tile QUIET waits for the previous release
        if QUIET >= 0:
            if HMARK:  # where the host marked it (gpu/hold.py reads the rule below off the program)
                if (_field(w, offs, W_FLAGS) & HOLD_WAIT) != 0:
                    hold_at = it + QUIET
            else:
                held = _streams(op)
                if QUIET_OPS != STREAMING:  # KernelConfig.held_ops: the hold for some streaming ops only
                    held = ((QUIET_OPS >> op) & 1) != 0
                if held & (released > 0) & (_field(w, offs, W_WAIT) != prev_wait):
                    hold_at = it + QUIET
        par = (released - 1) & 1  # the phase of that release; with HOFF (hold_count) its number, a count
        if HOFF > 0:
            par = released
        deep = False
        if DEEP > 0:  # KernelConfig.inflight_deep: these ops' tiles under the cap DEEP instead of INFLIGHT
            deep = ((DEEP_OPS >> op) & 1) != 0
        if op == OP_ATTN_IN:
            n_parts = _field(w, offs, W_C)  # column part b of n_parts (program.column_part)
            k0, k1 = _part_tiles(b, KT_D, n_parts)
            it = producer_weight_rows(d_qkv, D, (layer * NQKV + a) * HD, HD // TR, k0, k1, bufs, empty, ready, it,
                                      TR, TK, TILED, stamps, INFLIGHT, hold, hold_at, par, deep, DEEP, WOFF, HOFF)
        elif op == OP_O_PROJ:
            k0 = 0
            k1 = KT_Q
            if O_PARTS > 0:  # column part C of O_PARTS (KernelConfig.o_parts): its KV groups' column tiles
                k0, k1 = _part_tiles(_field(w, offs, W_C), KT_Q, O_PARTS)
            it = producer_weight_rows(d_o, HQ * HD, layer * D + a, b // TR, k0, k1, bufs, empty, ready, it, TR, TK,
                                      TILED, stamps, INFLIGHT, hold, hold_at, par, deep, DEEP, WOFF, HOFF)
        elif op == OP_MLP_IN:
            it = producer_weight_rows(d_gu, D, layer * 2 * I + 2 * a, 2 * b // TR, 0, KT_D, bufs, empty, ready, it,
                                      TR, TK, TILED, stamps, INFLIGHT, hold, hold_at, par, deep, DEEP, WOFF, HOFF)
        elif op == OP_DOWN_PROJ:
            k0 = 0
            k1 = KT_I
            if XD:  # a cluster pair's column half (KernelConfig.cluster_down)
                n_parts = _field(w, offs, W_D)
                if n_parts > 1:
                    k0, k1 = _part_tiles(_field(w, offs, W_C), KT_I, n_parts)
            it = producer_weight_rows(d_down, I, layer * D + a, b // TR, k0, k1, bufs, empty, ready, it, TR, TK,
                                      TILED, stamps, INFLIGHT, hold, hold_at, par, deep, DEEP, WOFF, HOFF)
        elif op == OP_LM_HEAD:
            it = producer_weight_rows(d_lm, D, a, b // TR, 0, KT_D, bufs, empty, ready, it, TR, TK, TILED, stamps,
                                      INFLIGHT, hold, hold_at, par, deep, DEEP, WOFF, HOFF)
        if QUIET >= 0:
            if _announces(w, offs, op, HMARK):
                released += 1
                if not HMARK:  # the loader's own rule (above) compares the next stage's wait with it
                    prev_wait = _field(w, offs, W_WAIT)


@gluon.jit
def _compute(prog_ptr, qlen_ptr, MAXLEN, tok_ptr, pos_ptr, ctx_ptr, bt_ptr, MAXP, cnt_ptr, NCNT, rdy_ptr,
             emb_ptr, anorm_ptr, mnorm_ptr, fnorm_ptr, bias_ptr, qn_ptr, kn_ptr, invf_ptr,
             kc_ptr, vc_ptr, NP, x_ptr, qkvp_ptr, q_ptr, po_ptr, pml_ptr, attn_ptr, act_ptr, logits_ptr, xp_ptr,
             SPLITS, eps, qscale, trace_ptr, tiles_ptr, MAXT, bufs, empty, ready, rel, hbuf,
             D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr, I: gl.constexpr,
             PS: gl.constexpr, HAS_BIAS: gl.constexpr, QK_NORM: gl.constexpr, BT: gl.constexpr,
             SP2: gl.constexpr, GP: gl.constexpr, WR: gl.constexpr, SG: gl.constexpr,
             DISPATCH: gl.constexpr, FLAG_ACT: gl.constexpr, FLAG_X: gl.constexpr, FLAG_ATTN: gl.constexpr,
             FLAG_Q: gl.constexpr, QKV_IN_ATTN: gl.constexpr, MERGE: gl.constexpr, kvbuf, KVP: gl.constexpr,
             O_PARTS: gl.constexpr, SHFL: gl.constexpr, NL: gl.constexpr, XB: gl.constexpr, XA: gl.constexpr,
             XD: gl.constexpr, QUIET: gl.constexpr, QUIET_EARLY: gl.constexpr, WOFF: gl.constexpr, TRACE: gl.constexpr,
             TRACE_TILES: gl.constexpr, HOFF: gl.constexpr, ROW1: gl.constexpr, XDS: gl.constexpr,
             HMARK: gl.constexpr, XDC: gl.constexpr, AMERGE: gl.constexpr, num_warps: gl.constexpr):
    TK: gl.constexpr = hbuf.type.shape[1]
    TR: gl.constexpr = bufs.type.shape[1] * bufs.type.shape[2] // TK  # slots are [TR, TK] or folded (matvec.py)
    # weight tile [TR, TK]: 16-byte vectors along K; WR warps down the rows, the rest side by side along K
    LAY: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WR, num_warps // WR], [1, 0])
    # staging group [SG column tiles, TK]: each row spread over every thread, the SG rows in registers
    S2: gl.constexpr = gl.BlockedLayout([1, TK // (32 * num_warps)], [1, 32], [1, num_warps], [1, 0])
    E2: gl.constexpr = gl.BlockedLayout([1, 1], [32 // TR, TR], [num_warps, 1], [1, 0])  # half head [HD/2TR, TR]
    # attention: [warp, GP heads, BT / num_warps positions, HD], 16-byte vectors along HD, one warp per position run
    TPD: gl.constexpr = 32 if HD // 8 > 32 else HD // 8
    L4: gl.constexpr = gl.BlockedLayout([1, GP, 1, 8], [1, 1, 32 // TPD, TPD], [num_warps, 1, 1, 1], [3, 2, 1, 0])
    TPR: gl.constexpr = 32 if HD // 4 > 32 else HD // 4
    R3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32 // TPR, TPR], [1, num_warps, 1], [2, 1, 0])
    WL: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    KT_D: gl.constexpr = (D + TK - 1) // TK
    KT_Q: gl.constexpr = (HQ * HD + TK - 1) // TK
    KT_I: gl.constexpr = (I + TK - 1) // TK
    KT_H: gl.constexpr = (KT_I + 1) // 2  # a DOWN_PROJ half's column tiles, at most (XDC)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    epoch = gl.load(cnt_ptr + NCNT + 1, cache_modifier=".cg")
    vstep = epoch * versioned.STEP_STRIDE  # versioned words of this step: vstep + readiness's number (versioned.py)
    n = gl.load(qlen_ptr + pid)
    tok = gl.load(tok_ptr)
    pos = gl.load(pos_ptr)
    ctx = gl.load(ctx_ptr)
    tok_page = gl.load(bt_ptr + pos // PS)
    emb_row = emb_ptr + tok.to(gl.int64) * D
    offs = gl.arange(0, WP2, WL)
    if TRACE_TILES:
        stamps = tiles_ptr + pid * MAXT * 4
    else:
        stamps = None
    tid = gl.arange(0, 32 * num_warps, WL)  # one element per compute thread
    if XB > 0:  # cluster pairs (isa.CLUSTER_PAIR): the exchange barriers, then this CTA's ready word moves to
        # epoch + 1 (release); the mate waits for it before its first exchange (cluster.pair_init)
        cluster.pair_init(tid, XB, XA)
        counter_signal(rdy_ptr, pid)
    xn = 0  # exchanges (cluster pair instructions) this CTA has run in this launch
    it = 0
    staged = -1  # (op, layer) whose input vector hbuf holds: consecutive blocks of one stage share it
    met_wait = -1  # the last (counter, target) this partition saw met: counters only grow within a step
    met_target = 0
    w_next = _words(prog_ptr, MAXLEN, 0, offs, n)
    for i in range(n):
        if DISPATCH:  # the next instruction's words are requested before this one's work, not after it
            w = w_next
            w_next = _words(prog_ptr, MAXLEN, i + 1, offs, n)
        else:
            w = _words(prog_ptr, MAXLEN, i, offs, n)
        op = _field(w, offs, W_OP)
        layer = _field(w, offs, W_LAYER)
        a = _field(w, offs, W_A)
        b = _field(w, offs, W_B)
        wait = _field(w, offs, W_WAIT)
        key = op * 65536 + layer
        if O_PARTS > 0:  # an O_PROJ part stages only its own columns: another part restages
            key = key + _field(w, offs, W_C) * 1048576
        if XDS:  # so does a DOWN_PROJ half (KernelConfig.down_half_stage; W_C its part)
            key = key + (op == OP_DOWN_PROJ).to(gl.int32) * _field(w, offs, W_C) * 1048576
        restage = key != staged
        staged = key
        if TRACE:
            t_start = globaltimer()
            t_first = t_start  # ATTN_PARTIAL's phase stamps, defined on every path (stored only for ATTN_PARTIAL;
            # t_ticket stays 0 for a split that draws no ticket)
            t_rest = t_start
            t_stored = t_start
            t_ticket = t_start * 0
        target = (epoch + 1) * _field(w, offs, W_WAIT_COUNT)
        if DISPATCH:  # a wait this partition already saw met (consecutive blocks of one stage) is not polled again
            if (wait == met_wait) & (target == met_target):
                wait = -1
            else:
                if wait >= 0:
                    met_wait = wait
                    met_target = target
        if op == OP_ATTN_PARTIAL:
            # past K/V of the first block is requested before the wait: it does not depend on this step
            kvh = a
            split = _field(w, offs, W_C)
            n_splits = _field(w, offs, W_D)
            k0, v0 = attention.prefetch(layer, kvh, b, split, n_splits, ctx, pos, kc_ptr, vc_ptr, bt_ptr,
                                        MAXP, NP, HKV, HD, PS, BT, num_warps, L4)
            if wait >= 0:
                counter_wait(cnt_ptr, wait, target)
            if TRACE:
                t_ready = globaltimer()
            fq, fk, fv = None, None, None
            if QKV_IN_ATTN:  # isa.QKV_IN_ATTN: this split finishes its heads from ATTN_IN's parts
                fq, fk, fv = attention.finish_heads(layer, kvh, pos, _field(w, offs, W_G), qkvp_ptr, bias_ptr, qn_ptr,
                                                    kn_ptr, invf_ptr, eps, HQ, HKV, HD, GP, HAS_BIAS, QK_NORM,
                                                    num_warps, L4)
            # (FLAG_Q and QKV_IN_ATTN exclude each other: KernelConfig.check)
            t_first, t_rest, t_stored = attention.partial(
                layer, kvh, b, split, n_splits, ctx, pos, k0, v0, q_ptr, kc_ptr, vc_ptr, bt_ptr, MAXP, NP,
                SPLITS, po_ptr, pml_ptr, HQ, HKV, HD, PS, qscale, BT, GP, num_warps, L4, vstep + layer, FLAG_Q,
                fq, fk, fv, tok_page, QKV_IN_ATTN, kvbuf, KVP, TRACE, ROW1, hbuf, AMERGE)
        else:
            if wait >= 0:
                counter_wait(cnt_ptr, wait, target)
            if TRACE:
                t_ready = globaltimer()
        sig = _field(w, offs, W_SIGNAL)
        if op == OP_ATTN_IN:
            if restage:
                matvec.stage_normed(hbuf, x_ptr, emb_row, layer == 0, anorm_ptr + layer * D, D, eps, KT_D, SG, S2,
                                    vstep + 2 * layer, FLAG_X)
            n_parts = _field(w, offs, W_C)
            k0, k1 = _part_tiles(b, KT_D, n_parts)
            if XB > 0:
                if xn == 0:  # the mate's exchange barriers exist before this CTA's first remote store and arrive
                    counter_wait(rdy_ptr, pid ^ 1, epoch + 1)
            it = matvec.qkv_part(bufs, empty, ready, hbuf, it, k0, k1, a, b, qkvp_ptr, HQ + 2 * HKV, HD, LAY, stamps,
                                 SHFL, xn, XB, XA, WOFF)
            if XB > 0:  # a cluster pair: the parts swap sums on chip, part 0 finishes (part 1's word: no signal)
                # the finish's step-independent inputs are requested before the exchange's wait, not after it
                pre = matvec.qkv_finish_inputs(layer, a, bias_ptr, qn_ptr, kn_ptr, invf_ptr, HQ, HKV, HD, HAS_BIAS,
                                               QK_NORM, TR, E2)
                if XA:
                    cluster.pair_meet_async(tid, xn, XB, HD)
                else:
                    cluster.pair_meet(tid, xn, XB)
                if b == 0:
                    matvec.qkv_finish(layer, a, n_parts, pos, tok_page, qkvp_ptr, q_ptr, kc_ptr, vc_ptr, bias_ptr,
                                      qn_ptr, kn_ptr, invf_ptr, eps, NP, HQ, HKV, HD, PS, HAS_BIAS, QK_NORM, TR, E2,
                                      vstep + layer, FLAG_Q, xn, XB, pre)
                xn += 1
            elif QKV_IN_ATTN:
                pass  # isa.QKV_IN_ATTN: the part signals; the ATTN_PARTIALs finish the head
            # ticket (isa.py): the last part finishes the head
            elif ticket_is_last(cnt_ptr, _field(w, offs, W_D), n_parts, epoch):
                matvec.qkv_finish(layer, a, n_parts, pos, tok_page, qkvp_ptr, q_ptr, kc_ptr, vc_ptr, bias_ptr, qn_ptr,
                                  kn_ptr, invf_ptr, eps, NP, HQ, HKV, HD, PS, HAS_BIAS, QK_NORM, TR, E2,
                                  vstep + layer, FLAG_Q)
            else:
                sig = -1  # an earlier part: no signal
        elif op == OP_ATTN_PARTIAL:
            # combining splits (isa.py): the last one reduces the group and signals (never with O_PROJ parts: the
            # O_PROJ blocks combine the splits)
            if (O_PARTS == 0) and (_field(w, offs, W_F) != 0):
                n_splits = _field(w, offs, W_D)
                last = ticket_is_last(cnt_ptr, _field(w, offs, W_E), n_splits, epoch)
                if TRACE:
                    t_ticket = globaltimer_after(last.to(gl.int32))
                if last:
                    attention.reduce(a, n_splits, SPLITS, po_ptr, pml_ptr, attn_ptr, HQ, HKV, HD, SP2, GP, R3,
                                     vstep + layer, FLAG_ATTN)
                else:
                    sig = -1
        elif op == OP_ATTN_REDUCE:
            attention.reduce(a, _field(w, offs, W_D), SPLITS, po_ptr, pml_ptr, attn_ptr, HQ, HKV, HD, SP2, GP,
                             R3, vstep + layer, FLAG_ATTN)
        elif op == OP_O_PROJ:
            if O_PARTS > 0:  # column part C (KernelConfig.o_parts): it combines its groups' splits itself
                part = _field(w, offs, W_C)
                if restage:
                    attention.stage_groups(hbuf, part * (HKV // O_PARTS), _field(w, offs, W_E), SPLITS, po_ptr,
                                           pml_ptr, HQ, HKV, HD, SP2, GP, R3, HKV // O_PARTS)
                k0, k1 = _part_tiles(part, KT_Q, O_PARTS)
                it = matvec.residual_rows(bufs, empty, ready, hbuf, it, k1, a, b // TR, x_ptr, emb_row, layer == 0,
                                          LAY, stamps, k0=k0, out_ptr=xp_ptr + part * D, add_res=part == 0,
                                          SHFL=SHFL, WOFF=WOFF)
            else:
                if restage:
                    if FLAG_ATTN:  # versioned attn words (isa.READS_ATTN): this load is the wait for attention
                        matvec.stage_versioned(hbuf, attn_ptr, HQ * HD, vstep + layer, KT_Q, SG, S2, FLAG_ATTN)
                    else:
                        matvec.stage_plain(hbuf, attn_ptr, HQ * HD, KT_Q, SG, S2)
                it = matvec.residual_rows(bufs, empty, ready, hbuf, it, KT_Q, a, b // TR, x_ptr, emb_row,
                                          layer == 0, LAY, stamps, vstep + 2 * layer, vstep + 2 * layer + 1, FLAG_X,
                                          SHFL=SHFL, WOFF=WOFF)
        elif op == OP_MLP_IN:
            if restage:
                matvec.stage_normed(hbuf, x_ptr, emb_row, False, mnorm_ptr + layer * D, D, eps, KT_D, SG, S2,
                                    vstep + 2 * layer + 1, FLAG_X, xp_ptr, O_PARTS)
            it = matvec.gated_rows(bufs, empty, ready, hbuf, it, KT_D, a, 2 * b // TR, act_ptr, LAY, stamps,
                                   vstep + layer, FLAG_ACT, SHFL, WOFF)
        elif op == OP_DOWN_PROJ:
            if restage:
                if FLAG_ACT:  # versioned act words (isa.READS_ACT): this load is the wait for MLP_IN
                    matvec.stage_versioned(hbuf, act_ptr, I, vstep + layer, KT_I, SG, S2, FLAG_ACT)
                elif XDS:  # a cluster pair's half stages its own column tiles only (KernelConfig.down_half_stage)
                    h0, h1 = _part_tiles(_field(w, offs, W_C), KT_I, gl.maximum(_field(w, offs, W_D), 1))
                    if XDC:  # from the staging buffer's first row (KernelConfig.half_hbuf; every DOWN_PROJ a half)
                        matvec.stage_span(hbuf, act_ptr, I, h0, h1, KT_H, SG, S2)
                    else:
                        matvec.stage_plain(hbuf, act_ptr, I, KT_I, SG, S2, h0, h1, True)
                else:
                    matvec.stage_plain(hbuf, act_ptr, I, KT_I, SG, S2)
            if XD:  # DOWN_PROJ's cluster pairs (KernelConfig.cluster_down): column halves of a row block on mates
                n_parts = _field(w, offs, W_D)
                if n_parts > 1:
                    if xn == 0:  # the mate's exchange barriers exist before this CTA's first remote store
                        counter_wait(rdy_ptr, pid ^ 1, epoch + 1)
                    k0, k1 = _part_tiles(_field(w, offs, W_C), KT_I, n_parts)
                    it, xn = matvec.residual_rows_pair(bufs, empty, ready, hbuf, it, k0, k1, a, b // TR, x_ptr,
                                                       _field(w, offs, W_C), xn, tid, LAY, XB, HD, stamps, SHFL, WOFF,
                                                       XDC)
                else:
                    it = matvec.residual_rows(bufs, empty, ready, hbuf, it, KT_I, a, b // TR, x_ptr, emb_row, False,
                                              LAY, stamps, SHFL=SHFL, WOFF=WOFF)
            else:
                it = matvec.residual_rows(bufs, empty, ready, hbuf, it, KT_I, a, b // TR, x_ptr, emb_row, False, LAY,
                                          stamps, vstep + 2 * layer + 1, vstep + 2 * layer + 2, FLAG_X, xp_ptr=xp_ptr,
                                          XP=O_PARTS, XS=D, SHFL=SHFL, WOFF=WOFF)
        elif op == OP_LM_HEAD:
            if restage:
                matvec.stage_normed(hbuf, x_ptr, emb_row, False, fnorm_ptr, D, eps, KT_D, SG, S2,
                                    vstep + 2 * NL, FLAG_X)
            it = matvec.plain_rows(bufs, empty, ready, hbuf, it, KT_D, a, b // TR, logits_ptr, LAY, stamps, SHFL,
                                   WOFF)
        if TRACE:
            t_release = globaltimer()
        sig_n = 1
        if MERGE:  # merged releases (isa.Word.SIGNAL_N): a run's last instruction adds the run's length
            sig_n = _field(w, offs, W_SIGNAL_N)
            if sig_n == 0:
                sig = -1
        if QUIET >= 0:  # the release hold: the releases the loader counts (_announces, _loader)
            if QUIET_EARLY:  # once the outputs are stored, before the release's fence: the loader requests
                # again while the fence waits (the arrive's partition barrier orders every thread's stores first)
                if _announces(w, offs, op, HMARK):
                    if HOFF > 0:
                        hold_count_add(tid, HOFF)
                    else:
                        mbarrier.arrive(rel.index(0), count=1)
        if sig >= 0:
            counter_signal(cnt_ptr, sig, sig_n)
        else:
            gl.thread_barrier()  # hbuf is rewritten by the next instruction
        if QUIET >= 0:
            if not QUIET_EARLY:  # after the release
                if _announces(w, offs, op, HMARK):
                    if HOFF > 0:
                        hold_count_add(tid, HOFF)
                    else:
                        mbarrier.arrive(rel.index(0), count=1)
        if TRACE:  # [start, dependency met, outputs stored, signalled] of instruction i on this SM; ATTN_PARTIAL
            # also [block 0 done, later blocks done, partial stored, ticket drawn] (trace.py)
            tb = trace_ptr + (pid * MAXLEN + i) * TRACE_STAMPS
            gl.store(tb, t_start)
            gl.store(tb + 1, t_ready)
            gl.store(tb + 2, t_release)
            gl.store(tb + 3, globaltimer())
            if op == OP_ATTN_PARTIAL:
                gl.store(tb + 4, t_first)
                gl.store(tb + 5, t_rest)
                gl.store(tb + 6, t_stored)
                gl.store(tb + 7, t_ticket)
    # step bookkeeping: the last CTA to finish moves every counter target on to the next step
    gl.thread_barrier()
    done = gl.atomic_add(cnt_ptr + NCNT, 1, sem="acq_rel", scope="gpu")
    if done == (epoch + 1) * nprog - 1:
        gl.atomic_add(cnt_ptr + NCNT + 1, 1, sem="release", scope="gpu")


@gluon.jit
def megakernel(prog_ptr, qlen_ptr, MAXLEN, tok_ptr, pos_ptr, ctx_ptr, bt_ptr, MAXP, cnt_ptr, NCNT, rdy_ptr,
               d_qkv, d_o, d_gu, d_down, d_lm,
               emb_ptr, anorm_ptr, mnorm_ptr, fnorm_ptr, bias_ptr, qn_ptr, kn_ptr, invf_ptr,
               kc_ptr, vc_ptr, NP, x_ptr, qkvp_ptr, q_ptr, po_ptr, pml_ptr, attn_ptr, act_ptr, logits_ptr, xp_ptr,
               SPLITS, eps, qscale, trace_ptr, tiles_ptr, MAXT,
               D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, HD: gl.constexpr, I: gl.constexpr,
               PS: gl.constexpr, HAS_BIAS: gl.constexpr, QK_NORM: gl.constexpr,
               TR: gl.constexpr, TK: gl.constexpr, NB: gl.constexpr, KT_ROWS: gl.constexpr, SG: gl.constexpr,
               BT: gl.constexpr, SP2: gl.constexpr, GP: gl.constexpr, WR: gl.constexpr, LOADER_REGS: gl.constexpr,
               TILED: gl.constexpr, INFLIGHT: gl.constexpr, DISPATCH: gl.constexpr,
               FLAG_ACT: gl.constexpr, FLAG_X: gl.constexpr, FLAG_ATTN: gl.constexpr, FLAG_Q: gl.constexpr,
               QKV_IN_ATTN: gl.constexpr, MERGE: gl.constexpr, KVP: gl.constexpr, O_PARTS: gl.constexpr,
               SHFL: gl.constexpr, NL: gl.constexpr, XB: gl.constexpr, XA: gl.constexpr, XD: gl.constexpr,
               QUIET: gl.constexpr,
               QUIET_EARLY: gl.constexpr, QUIET_OPS: gl.constexpr, DEEP: gl.constexpr, DEEP_OPS: gl.constexpr,
               WREL: gl.constexpr, HCNT: gl.constexpr, ROW1: gl.constexpr, XDS: gl.constexpr, HMARK: gl.constexpr,
               XDC: gl.constexpr, AMERGE: gl.constexpr, TRACE: gl.constexpr, TRACE_TILES: gl.constexpr,
               num_warps: gl.constexpr):
    # ring slots: the descriptors' box, [TR, TK] or the folded [TR * TK / 32, 32] of tensor-core consumption
    bufs = gl.allocate_shared_memory(d_qkv.dtype, [NB, d_qkv.block_type.shape[0], d_qkv.block_type.shape[1]],
                                     d_qkv.layout)
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    # hbuf: staged input vector, one [TK] row per column tile (rank-1 layout: rows are indexed at run time),
    # KT_ROWS = column tiles of the widest input, rounded up to a power of two (whole staging groups of SG)
    hbuf = gl.allocate_shared_memory(gl.bfloat16, [KT_ROWS, TK],
                                     gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if KVP:  # the attention's later K/V blocks, two stages of K and V (attention.partial, kv_pipeline)
        kvbuf = gl.allocate_shared_memory(gl.bfloat16, [4, num_warps, BT // num_warps, HD],
                                          gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    else:
        kvbuf = hbuf  # unused
    ring_init(empty, ready, NB)
    # per-warp slot releases (KernelConfig.warp_release): the empty barriers the warps arrive on, WREL bytes before
    # the cluster exchange region at the end of the dynamic shared memory (orchestration.warp_release)
    WOFF: gl.constexpr = XB + WREL if WREL > 0 else 0
    if WREL > 0:
        warp_ring_init(gl.arange(0, 32 * num_warps, gl.BlockedLayout([1], [32], [num_warps], [0])), NB, WOFF,
                       num_warps)
    # the release hold (KernelConfig.quiet): one arrival a phase, compute's after each announced release; or
    # (HCNT, KernelConfig.hold_count) compute's count of those releases, 16 bytes before the per-warp releases'
    # barriers in the dynamic shared memory past Triton's (orchestration.hold_count_*)
    HOFF: gl.constexpr = XB + WREL + 16 if HCNT else 0
    if HCNT:
        hold_count_init(gl.arange(0, 32 * num_warps, gl.BlockedLayout([1], [32], [num_warps], [0])), HOFF)
    if (QUIET >= 0) and not HCNT:
        rel = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(rel.index(0), count=1)
    else:
        rel = empty  # unused (its index 0 is never waited on or arrived at)
    gl.warp_specialize([
        (_compute, (prog_ptr, qlen_ptr, MAXLEN, tok_ptr, pos_ptr, ctx_ptr, bt_ptr, MAXP, cnt_ptr, NCNT, rdy_ptr,
                    emb_ptr, anorm_ptr, mnorm_ptr, fnorm_ptr, bias_ptr, qn_ptr, kn_ptr, invf_ptr,
                    kc_ptr, vc_ptr, NP, x_ptr, qkvp_ptr, q_ptr, po_ptr, pml_ptr, attn_ptr, act_ptr, logits_ptr, xp_ptr,
                    SPLITS, eps, qscale, trace_ptr, tiles_ptr, MAXT, bufs, empty, ready, rel, hbuf, D, HQ, HKV, HD, I,
                    PS, HAS_BIAS, QK_NORM, BT, SP2, GP, WR, SG, DISPATCH, FLAG_ACT, FLAG_X, FLAG_ATTN, FLAG_Q,
                    QKV_IN_ATTN, MERGE, kvbuf, KVP, O_PARTS, SHFL, NL, XB, XA, XD, QUIET, QUIET_EARLY, WOFF, TRACE,
                    TRACE_TILES, HOFF, ROW1, XDS, HMARK, XDC, AMERGE, num_warps)),
        (_loader, (prog_ptr, qlen_ptr, MAXLEN, d_qkv, d_o, d_gu, d_down, d_lm, bufs, empty, ready, rel,
                   tiles_ptr, MAXT, D, HQ, HKV, HD, I, TR, TK, TILED, INFLIGHT, QUIET, QUIET_OPS, O_PARTS,
                   DEEP, DEEP_OPS, WOFF, XD, TRACE_TILES, HOFF, HMARK)),
    ], [1], [LOADER_REGS])
