"""The persistent megakernel: one CTA per SM runs its queue of the step program (program.py, plan.py).

Roles (``gl.warp_specialize``):
  compute (default partition, NW warps): for each instruction, wait on its dependency counter (acquire), run the
      instruction's device code (its ``ops`` module: stage its input vector in shared memory, consume its weight
      tiles from the ring, epilogue, store), and signal its counter (release).
  loader (1 warp, small register budget; device/ring.py): walks the SAME queue and streams every instruction's
      weight tiles, as its words name them (isa.TileSpan), with TMA into the ring, and every one-token attention
      split's past K/V (a one-token step's, a multi-token step's one-token groups': device/kv_stream.py). It never
      waits on a counter, so it prefetches the next instructions' weights and K/V (next layer included) while
      compute waits for dependencies; an MoE expert span first waits for its routing entry (the one wait on step
      data: device/ring.py, traced by device/route_wait.py).
Tensor parallelism (``C.TP`` ranks, each its own kernel: device/peer.py): PEER-flagged instructions send their
partials to every rank's inbox and signal every rank's peer counter; REDUCE waits for its own peer counter at system
scope. With cluster pairs (``C.XB``) the CTAs run in clusters of two, and the two parts of a paired instruction swap
their sums through distributed shared memory (device/cluster.py). At the end each CTA adds 1 to the DONE counter;
the CTA that completes it bumps EPOCH, which moves every counter's step-numbered target for the next launch (no reset
kernel, CUDA-graph friendly).

Dispatch reads the op table (ops/): one line per instruction. Compute requests instruction i + 1's words before
instruction i's work, and does not poll again a dependency it already saw met (consecutive blocks of one stage).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..ops import (attn_in, attn_partial, down_proj, expert_down, expert_in, lm_head, mlp_in, o_proj, reduce,
                   router)
from . import cluster, kv_stream, layouts, matvec_mt, peer, ring
from .context import (HOLD_ARRIVE, NWORDS, OP_ATTN_IN, OP_ATTN_PARTIAL, OP_DOWN_PROJ, OP_EXPERT_DOWN, OP_EXPERT_IN,
                      OP_LM_HEAD, OP_MLP_IN, OP_O_PROJ, OP_REDUCE, OP_ROUTER, PEER, W_C, W_FLAGS, W_LAYER, W_OP,
                      W_SIGNAL, W_WAIT, W_WAIT_COUNT, Bufs, Ins, Smem, Step)
from .sync import counter_signal, counter_wait, globaltimer

TRACE_STAMPS: gl.constexpr = gl.constexpr(4)  # [start, dependency met, outputs stored, signalled] (tools/trace.py)


@gluon.jit
def _words(words_ptr, MAXLEN, i, offs, n):
    """Instruction i of this CTA's queue (zeros past the queue's end): all NWORDS words in one vector load."""
    return gl.load(words_ptr + (gl.program_id(0) * MAXLEN + i) * NWORDS + offs, mask=(offs < NWORDS) & (i < n),
                   other=0)


@gluon.jit
def _compute(prog, step, vecs, kv, scratch, scalars, trace_ptr, peers, sm, ep_bar, C: gl.constexpr):
    words_ptr, lens_ptr, MAXLEN = prog
    tok_ptr, pos_ptr, ctx_ptr, new_ptr, bt_ptr, MAXP, cnt_ptr, NCNT, rdy_ptr = step
    b = Bufs(vecs, kv, scratch, scalars, peers)
    WL: gl.constexpr = layouts.thread(C)
    pid = gl.program_id(0)
    epoch = gl.load(cnt_ptr + NCNT + 1, cache_modifier=".cg")
    n = gl.load(lens_ptr + pid)
    tok = gl.load(tok_ptr)
    pos = gl.load(pos_ptr)
    s = Step(cnt_ptr, NCNT, rdy_ptr, bt_ptr, MAXP, epoch, pos, gl.load(ctx_ptr), gl.load(bt_ptr + pos // C.PS),
             b.emb + tok.to(gl.int64) * C.D, tok_ptr, pos_ptr, ctx_ptr, new_ptr)
    offs = gl.arange(0, 16, WL)
    tid = gl.arange(0, 32 * C.NW, WL)  # one element per compute thread
    if C.XB > 0:  # cluster pairs: the exchange barriers, then this CTA's ready word moves to epoch + 1 (release);
        # the mate waits for it before its first exchange
        cluster.pair_init(tid, C.XB)
        counter_signal(rdy_ptr, pid)
    xn = 0  # exchanges (cluster pair instructions) this CTA has run in this launch
    it = 0  # the ring's running tile counter
    staged = -1  # (op, layer[, half]) whose input vector hbuf holds: consecutive blocks of one stage share it
    met_wait = -1  # the last (counter, target) this partition saw met: counters only grow within a step
    met_target = 0
    w_next = _words(words_ptr, MAXLEN, 0, offs, n)
    for i in range(n):
        ins = Ins(w_next, offs)
        w_next = _words(words_ptr, MAXLEN, i + 1, offs, n)  # requested before this instruction's work
        op = ins.field(W_OP)
        wait = ins.field(W_WAIT)
        # EXPERT_IN stages what its layer's ROUTER staged (RMSNorm(x)): one key; EXPERT_DOWN stages its slot's input
        key = (op - (op == OP_EXPERT_IN).to(gl.int32) * (OP_EXPERT_IN - OP_ROUTER)) * 65536 + ins.field(W_LAYER)
        key = key + (op == OP_EXPERT_DOWN).to(gl.int32) * ins.field(W_C) * 1048576
        if C.DOWN_PAIRS or C.M > 1:  # a DOWN_PROJ half (or column part) stages only its own columns: the other
            # part restages
            key = key + (op == OP_DOWN_PROJ).to(gl.int32) * ins.field(W_C) * 1048576
        restage = key != staged
        staged = key
        if C.TRACE:
            t_start = globaltimer()
        target = (epoch + 1) * ins.field(W_WAIT_COUNT)
        if (wait == met_wait) & (target == met_target):  # already seen met: no poll
            wait = -1
        else:
            if wait >= 0:
                met_wait = wait
                met_target = target
        sig = ins.field(W_SIGNAL)
        if op == OP_ATTN_PARTIAL:  # the wait is its own (a multi-token step requests its first K/V block first)
            sig, t_ready, it = attn_partial.compute(ins, C, s, b, sm, it, wait, target, sig)
        else:
            if wait >= 0:
                if C.TP > 1:  # a REDUCE's peer counter is signalled from every rank's GPU: system scope
                    if op == OP_REDUCE:
                        counter_wait(cnt_ptr, wait, target, True)
                    else:
                        counter_wait(cnt_ptr, wait, target)
                else:
                    counter_wait(cnt_ptr, wait, target)
            t_ready = 0
            if C.TRACE:
                t_ready = globaltimer()
            if op == OP_ATTN_IN:
                it, xn, sig = attn_in.compute(ins, C, s, b, sm, it, xn, restage, tid, sig)
            elif op == OP_O_PROJ:
                it = o_proj.compute(ins, C, s, b, sm, it, restage)
            elif op == OP_MLP_IN:
                it = mlp_in.compute(ins, C, s, b, sm, it, restage)
            elif op == OP_DOWN_PROJ:
                it, xn, sig = down_proj.compute(ins, C, s, b, sm, it, xn, restage, tid, sig)
            elif op == OP_LM_HEAD:
                it = lm_head.compute(ins, C, s, b, sm, it, restage)
            if C.TP > 1:
                if op == OP_REDUCE:
                    reduce.compute(ins, C, s, b)
            if C.S > 0:  # MoE layers: a dense model's kernel compiles none of it
                if op == OP_ROUTER:
                    it, sig = router.compute(ins, C, s, b, sm, it, restage, sig)
                elif op == OP_EXPERT_IN:
                    it, kept = expert_in.compute(ins, C, s, b, sm, it, restage)
                    staged = gl.where(kept, staged, -1)  # an unused slot staged nothing
                elif op == OP_EXPERT_DOWN:
                    it, sig, kept = expert_down.compute(ins, C, s, b, sm, it, restage, sig)
                    staged = gl.where(kept, staged, -1)
        if C.TRACE:
            t_release = globaltimer()
        if sig >= 0:
            if C.TP > 1:  # a PEER instruction's counter is in every rank's table
                if (ins.field(W_FLAGS) & PEER) != 0:
                    peer.signal(b, sig, C)
                else:
                    counter_signal(cnt_ptr, sig)
            else:
                counter_signal(cnt_ptr, sig)
        else:
            gl.thread_barrier()  # hbuf is rewritten by the next instruction
        if C.QUIET >= 0:  # the release hold: compute announces the releases the host marked (hold.py)
            if (ins.field(W_FLAGS) & HOLD_ARRIVE) != 0:
                mbarrier.arrive(sm.rel.index(0), count=1)
        if C.TRACE:
            tb = trace_ptr + (pid * MAXLEN + i) * TRACE_STAMPS
            gl.store(tb, t_start)
            gl.store(tb + 1, t_ready)
            gl.store(tb + 2, t_release)
            gl.store(tb + 3, globaltimer())
    # step bookkeeping: the last CTA to finish moves every counter target on to the next step
    if C.S > 0:  # not before this CTA's loader has read the epoch (its routing tags: device/ring.py)
        mbarrier.wait(ep_bar.index(0), 0)
    gl.thread_barrier()
    done = gl.atomic_add(cnt_ptr + NCNT, 1, sem="acq_rel", scope="gpu")
    if done == (epoch + 1) * gl.num_programs(0) - 1:
        gl.atomic_add(cnt_ptr + NCNT + 1, 1, sem="release", scope="gpu")


@gluon.jit
def megakernel(prog, step, weights, vecs, kv, k_desc, v_desc, scratch, scalars, trace, peers, C: gl.constexpr):
    """One decode step. Arguments as launch/args.py describes them; ``C`` is plan.Constants."""
    # ring slots: the tile array's [TR * TK / 32, 32] rows of one tile (device/matvec.dot_tile reads them folded)
    bufs = gl.allocate_shared_memory(weights.dtype, [C.NB, weights.block_type.shape[0], weights.block_type.shape[1]],
                                     weights.layout)
    empty = gl.allocate_shared_memory(gl.int64, [C.NB, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [C.NB, 1], mbarrier.MBarrierLayout())
    rel = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    if C.M > 1:  # hbuf: the tokens' staged inputs, [MB, 32] chunks; wbuf: a norm's weights (device/matvec_mt.py)
        hbuf = gl.allocate_shared_memory(gl.bfloat16, [C.KT_ROWS * (C.TK // 32), C.MB, 32], matvec_mt.xs_layout(C))
        wbuf = gl.allocate_shared_memory(gl.bfloat16, [matvec_mt.wbuf_rows(C), 32], matvec_mt.wbuf_layout(C))
    else:  # hbuf: staged input vector, one [TK] row per column tile (rank-1 layout: rows are indexed at run time)
        hbuf = gl.allocate_shared_memory(gl.bfloat16, [C.KT_ROWS, C.TK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        wbuf = hbuf
    sbuf = hbuf
    if C.KVS > 0:
        if C.FP8:  # the scales of the K/V rows each slot holds (device/kv_stream.py), beside the ring
            sbuf = gl.allocate_shared_memory(gl.bfloat16, [C.NB, 2 * C.KVS // C.KVBOX, C.KVBOX], kv_stream.flat(2))
    ring.ring_init(empty, ready, C.NB)
    mbarrier.init(rel.index(0), count=1)  # the release hold: one arrival a phase, compute's after a marked release
    if C.S > 0:  # MoE: the loader has read the step's epoch (device/ring.py)
        ep_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(ep_bar.index(0), count=1)
    else:  # a dense kernel never arrives at or waits on it: the release hold's barrier stands in. A barrier of its
        # own, initialised and then dead, had its bytes reused by Triton's allocator for live data (smollm2: the
        # staging buffer), whose stores then overwrote a valid mbarrier without mbarrier.inval (undefined in PTX)
        ep_bar = rel
    sm = Smem(bufs, empty, ready, rel, hbuf, wbuf, sbuf)
    # the loader's K/V stream: the pools' descriptors, their scales, block tables and width, the context pointer (a
    # multi-token step's: seg_ctx and seg_new, each one-token segment's context and first written position), the
    # page count
    if C.M > 1:
        kvs = (k_desc, v_desc, kv[2], kv[3], step[4], step[5], (step[2], step[3]), kv[4])
    else:
        kvs = (k_desc, v_desc, kv[2], kv[3], step[4], step[5], step[2], kv[4])
    LOADER_REGS: gl.constexpr = C.LOADER_REGS
    gl.warp_specialize([
        (_compute, (prog, step, vecs, kv, scratch, scalars, trace[0], peers, sm, ep_bar, C)),
        (ring.loader, (prog, (step[6], step[7], scratch[13], trace[1]), kvs, weights, bufs, sbuf, empty, ready,
                       rel, ep_bar, C)),
    ], [1], [LOADER_REGS])
