"""KernelConfig: the megakernel's tile and ring shape, and the constexpr/signature set for one ModelSpec.

One kernel source serves every model: all model sizes reach the kernel as constexprs derived here from the
ModelSpec (nothing is compiled in), together with the tile shape. ``compile_sm90a`` compiles a specialisation for
Hopper on any machine (no GPU needed) — used by CI to catch compile errors and to read the PTX.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...models.spec import ModelSpec
from .. import isa
from ..program import Program, ProgramConfig, StepShape, build_program


@dataclass(frozen=True)
class KernelConfig:
    tile_rows: int = 32  # TR: weight tile rows (also the scheduler's row-block granule)
    tile_k: int = 256  # TK: weight tile columns (bf16); 16 KB tiles at 32 x 256 (best of the first sweep)
    ring: int = 0  # NB: ring slots (0: as many as fit in shared memory, ring_slots(): 12 for the 1B, 11 for
    # the 8B). Against 10: -0.5% / +0.2% at 29bb7db (noise then); -1.3% / -0.9% at fa1ad1d in two pairs each, the
    # default since session 21 (bench/NOTES.md; traced: the 1B's MLP_IN and DOWN_PROJ -0.2 / -0.4 us a layer)
    num_warps: int = 4  # compute partition warps
    loader_regs: int = 48  # register budget of the one-warp loader partition (what session 9's runs measured)
    page_size: int = 16
    inflight: int = 4  # INFLIGHT: weight tiles the loader may have requested and not yet landed (0: the ring's NB);
    # fewer requests queued in the memory system shorten every round trip the step's hops make (the counter
    # release's MEMBAR, the polls, the staging loads): at 4, tile latency 4.4 -> 1.9 us and the step -2.6% (1B) /
    # -3.4% (8B) at 8865813, -1.8% / -3.8% at 3e53b96 (2 too few: +5%); the default since session 13
    quiet: int = 2  # QUIET (-1: off): at most ``quiet`` tiles of a streaming instruction are requested before this
    # SM's previous signalling streaming instruction has released its counter, where the two wait for different
    # counters (a new stage): the release's MEMBAR waits for this CTA's memory traffic, and the tiles the loader
    # requested last are still in flight behind it. Measured at 9ea1dc4: the streaming releases 2.5 -> 0.8 us
    # (1B MLP_IN), 2.8 -> 0.8 (8B O_PROJ), the step -1.7% (1B) / -1.7% (8B); 0 and 4: -1.7 / -1.3%, -2.2 / -1.1%.
    # The default since session 17
    hold_count: bool = False  # HCNT: the release hold through compute's count of its releases, a word in the
    # dynamic shared memory past Triton's (orchestration.hold_count_*), instead of the mbarrier. Built when compute
    # arrived at every release and the loader waited only at a stage's first instruction, so synccheck reported
    # "Missing wait" on the barrier's unwaited phases (bench/NOTES.md session 19 §2; ``hold_marks`` has since removed
    # them). A count has no phases to miss or alias:
    # synccheck 0 errors on every sanitize.py case at d6bd909. Opt-in: measured 1B -0.1% / +0.2%, 8B +0.9% / +0.4%
    # in two runs (session 20)
    hold_marks: bool = True  # HMARK: compute announces only the releases the loader holds for, and the loader holds
    # only where marked, both read off the program by the host (gpu/hold.py, isa.HOLD_ARRIVE / HOLD_WAIT on the
    # words): every phase of the hold's mbarrier is waited for, so synccheck has no "Missing wait" to report. False:
    # compute arrives after every signalling streaming release and the loader applies the rule itself (sessions 17-20)
    quiet_ops: tuple[str, ...] = ()  # QUIET_OPS: the streaming ops (isa.Op names) whose instructions the hold
    # applies to; () = every one (session 17, opt-in). Measured at b8036be: all but ATTN_IN -1.2% (1B) / 0.0% (8B),
    # MLP_IN and DOWN_PROJ only -0.4% / +0.8%, within the default's drift (bench/NOTES.md session 18)
    quiet_early: bool = False  # QUIET_EARLY: compute ends the hold once its outputs are stored, before the release's
    # fence rather than after it, so the loader requests again while the fence waits: if the fence waits only for
    # the traffic issued before it (the stores' acknowledgements ahead of later tile data), the release stays quiet
    # and the held tiles come ~1 release sooner (session 17, opt-in). Measured at b8036be: +2.3% (1B) / +1.8% (8B),
    # the releases' cost back: the fence also waits for the requests issued after the arrival
    inflight_deep: int = 0  # DEEP (0: off): the in-flight cap for the instructions of ``deep_ops`` instead of
    # ``inflight``. A stage streamed by fewer SMs than the GPU has (the 1B's DOWN_PROJ and O_PROJ: 64 row tiles a
    # layer on 132 SMs) draws only those SMs' share of HBM at the common cap (session 17: one tile fewer in flight
    # slowed the 1B's DOWN_PROJ 10.2 -> 11.0 us). Opt-in (session 18); measured at 06d2a52 with DOWN_PROJ at 6 / 8:
    # -0.5% / -0.6% (1B), -0.2% / +0.4% (8B): those instructions are bound by their consumers' work on the tiles, not
    # by their requests in flight (bench/NOTES.md session 18 §1, §3)
    deep_ops: tuple[str, ...] = ()  # DEEP_OPS: the streaming ops (isa.Op names) under ``inflight_deep``
    warp_release: bool = False  # WREL: each consumer warp hands a ring slot back on its own (its lane 0 arrives on an
    # empty barrier counted in warps, in the dynamic shared memory past Triton's; orchestration.warp_release)
    # instead of one thread after a partition barrier: one of the tile loop's two CTA barriers a tile (the other
    # comes with Triton's mbarrier.wait and stays) (session 18, opt-in). Measured at d7946e5: +1.9% (1B) / +0.3% (8B)
    # (bench/NOTES.md session 19 §0). Its ring is at most WARP_RELEASE_SLOTS deep (wrong results deeper, session 22)
    dispatch: bool = True  # DISPATCH: compute requests instruction i + 1's words before instruction i's work, and
    # does not poll again a dependency it already saw met (consecutive blocks of one stage); measured -1.3% (1B) /
    # -0.6% (8B) alone at fe6ffd2; with the next three defaults -3.9% / -2.0% against session 11's at a4a86e4
    # The versioned-word hops (gpu/versioned.py), measured at 3e53b96 (1B / 8B, context 1024, against the default
    # of that run): flag_act +1.6% / +1.8%, + flag_x, flag_attn +4.6% / +4.2%, all four +12% / +8%; the release and
    # the poll are gone from the trace, but every stage around a versioned hop got slower (bench/NOTES.md session 13)
    flag_act: bool = False  # FLAG_ACT: MLP_IN -> DOWN_PROJ through versioned act words (isa.READS_ACT;
    # ProgramConfig.flag_act): no release fence after MLP_IN, no counter poll before DOWN_PROJ
    flag_x: bool = False  # FLAG_X: the residual stream x as versioned words too (isa.READS_X): O_PROJ and DOWN_PROJ
    # signal nothing, ATTN_IN, MLP_IN and LM_HEAD poll no counter
    flag_attn: bool = False  # FLAG_ATTN: the attention output as versioned words too (isa.READS_ATTN; needs flag_x):
    # the combining split signals nothing, O_PROJ polls no counter
    flag_q: bool = False  # FLAG_Q: q and the new K/V row as versioned words (isa.READS_Q): ATTN_IN's finishers
    # signal nothing, ATTN_PARTIAL polls no counter
    merge_signals: bool = False  # MERGE: a run of same-counter instructions on one SM releases once, at its end
    # (ProgramConfig.merge_signals, isa.Word.SIGNAL_N): 92 of the 8B's 224 MLP_IN blocks a layer follow one of their
    # own stage on the same SM; measured +1.1% (1B) / +0.1% (8B) at 9c38a10
    kv_pipeline: bool = False  # KVP: an attention split's later K/V blocks through shared memory, two stages of
    # cp.async (attention.partial): at context 8192 a split has 8 (1B) / 16 (8B) blocks and each later one cost a
    # round trip in series (bench/NOTES.md session 13 §6); 4 * BT * HD * 2 bytes of shared memory (32 KB at every
    # default shape) come off the ring's room; measured -1.8% (1B and 8B) at context 8192, +1.2% / +0.9% at 1024
    # (9c38a10)
    qkv_in_attn: bool = False  # QKV_IN_ATTN: ATTN_IN's heads finished by the ATTN_PARTIALs that read them
    # (isa.QKV_IN_ATTN, ProgramConfig.qkv_in_attn): no ticket, no finisher round trip in ATTN_IN; measured +0.5% (1B)
    # / +5.5% (8B) at 1b8fdc5: each split's finish costs more than ATTN_IN's tail saves
    o_parts: int = 0  # O_PARTS: O_PROJ split over its columns into this many parts of Hkv / o_parts KV groups
    # (ProgramConfig.o_parts): the attention splits signal their part's counter (no ticket, no combining split),
    # each O_PROJ block combines its groups' partials itself and stores its x part; MLP_IN's staging and
    # DOWN_PROJ's residual rows sum the parts. A ticket, a release and a staging round trip leave the attention ->
    # O_PROJ hop; every MLP_IN staging reads o_parts vectors instead of one (bench/NOTES.md session 14): at 8,
    # -0.2% (1B) / +1.3% (8B) at 9c38a10 (the part blocks' many short row tiles cost what the hop saves)
    fold_shuffle: bool = False  # SHFL: the tensor-core epilogue sums a row's folds with warp shuffles (the diagonal
    # reshaped in place) instead of two layout conversions through shared memory: one barrier a row tile instead of
    # three (matvec.dot_tile_mma); the O_PROJ part blocks (o_parts) pay that epilogue on 4-8x more row tiles;
    # within +-1% of the default in three runs (bench/NOTES.md session 15)
    cluster_qkv: int = 2  # XB, XA: ATTN_IN's two column parts of a head on the two CTAs of a thread-block cluster
    # (isa.CLUSTER_PAIR, ProgramConfig.cluster_qkv): they swap sums through distributed shared memory and an
    # mbarrier (gpu/cluster.py) instead of a ticket and a global round trip; the kernel is launched in clusters of
    # two with the exchange region past Triton's shared memory. 0: tickets. 1: remote stores, then every thread
    # arrives on the mate's barrier with release at cluster scope (a MEMBAR.GPU in the SASS). 2 (XA, the default
    # since session 16): asynchronous remote stores (st.async) that count their bytes on the mate's barrier, no
    # fence; measured -2.3% (1B) / -1.5% (8B) against tickets, mode 1 -1.9% / -1.0% (b2a8ca6, bench/NOTES.md
    # session 16). In effect only where a head has two parts to pair and without versioned words (``clusters()``)
    cluster_down: bool = True  # XD: DOWN_PROJ's two column halves of a row block on the two CTAs of a cluster
    # where its row blocks are at most half the SMs (the 1B's 64 row tiles on 132 SMs; ProgramConfig.cluster_down):
    # part 1 sends its row tile's sums to part 0 with st.async, part 0 adds them and the residual and stores x. The
    # 1B's DOWN_PROJ instructions were bound by their own work on the tiles (session 18 §3): twice the SMs, half the
    # tiles each. Measured -2.3% (1B; DOWN_PROJ's window 11.2 -> 9.4 us), 8B unchanged (its 128 row blocks do not
    # pair) at d7946e5 (bench/NOTES.md session 19). In effect with cluster_qkv's mode 2 exchange only, and not with
    # o_parts or merged releases (``down_pairs()``)
    down_half_stage: bool = True  # XDS: a DOWN_PROJ half (cluster_down) stages only the act column tiles it
    # multiplies: one staging group of the 1B's two (8192 of 16384 activations, 16 column tiles), so one round trip
    # instead of two before its first tile (a whole DOWN_PROJ staged in 1.47 us, session 18 §3); in effect with
    # ``down_pairs()``. Measured at d6bd909: 1B -1.3% alone, -2.4% with attn_row; the 8B has no pairs (session 20)
    half_hbuf: bool = True  # XDC: with ``down_half_stage`` in effect, each DOWN_PROJ half stages its act columns
    # from the staging buffer's first row and reads them there, so the buffer holds the widest of D, q_size and half
    # of I (the 1B: 8 KB instead of 16) and the ring takes the bytes freed (``ring_slots``: 13 slots on the 1B
    # instead of 12). Every DOWN_PROJ of the program must then be a half: ``for_launch`` turns it off where one is
    # not (the 8B; the 1B on fewer than 128 SMs). Built in session 21; measured at 6e7b470 -0.5% / -0.3% (1B, two
    # pairs), the 8B's kernel unchanged; the default since session 22 (bench/NOTES.md)
    attn_smem_merge: bool = True  # AMERGE: ATTN_PARTIAL merges its warps' online-softmax states through the
    # staging buffer (free during attention) with one partition barrier (attention._merge_smem) instead of Triton's
    # reductions over the warp axis (9 partition barriers in the SASS; traced at 1d943ce, 1.6 us a split on the 1B,
    # 2.6 on the 8B). Measured -3.1% (1B) / -2.2% (8B) at 1d943ce, the default since session 22 (bench/NOTES.md).
    # In effect where the buffer holds the states (``smem_merge``: not SmolLM2's 2 KB)
    attn_row: bool = True  # ROW1: the attention split that holds the step's row (the last, state.split_range)
    # adds it as a block one position wide instead of a masked 64-position block (attention.partial): traced at
    # 46549a9 that split's block-0 phase took 2.44 us against 1.59 for the others and it drew the combining ticket
    # (bench/NOTES.md session 19 §1). Measured at d6bd909: 1B -1.5%, 8B -0.9% (session 20)
    vprobe: int = 1  # a versioned staging of x, attn or act (not the few words of q, K/V or a residual tile) that
    # finds words missing spins on one word in vprobe (versioned.wait's probes), then loads the missing ones again:
    # 1/vprobe of the polling traffic an early reader sends to L2, for one more round trip when it had to wait; the
    # kernel gets it as the value of FLAG_ACT / FLAG_X / FLAG_ATTN (0: off); not yet measured
    trace: bool = False  # record [start, dependency met, outputs stored, signalled] per instruction (gpu/trace.py)
    trace_tiles: bool = False  # per weight tile: loader wants / gets its slot, compute wants / has its data (trace.py)
    qkv_parts: int = 0  # ATTN_IN column parts per head (0: the scheduler's cost model chooses)
    min_split_tokens: int = 32  # attention splits get at least this many positions (ProgramConfig): 16 splits a
    # KV head at context 1024 on 132 SMs with 8 KV heads; larger -> fewer, longer splits and a smaller combine
    combine_splits: bool = True  # attention splits combine themselves (no ATTN_REDUCE stage; program.py)
    fixed_cost_kb: int = 96  # the scheduler's per-instruction cost in weight kilobytes (ProgramConfig); session 11
    # measured 2-5 us of staging + tail per matvec instruction, ~70-170 KB at an SM's HBM share. With max_block_kb
    # 1024 (1B: 62 instructions an SM instead of 89) measured -3.6% (1B) / -1.5% (8B) against 16 and 256, a4a86e4
    max_block_kb: int = 1024  # cap on one matvec instruction's weight kilobytes (ProgramConfig.max_block_bytes)
    signal_logits: bool = False  # LM_HEAD blocks signal a counter nobody waits on (ProgramConfig.signal_logits);
    # False measured -1.7% (1B) / -0.2% (8B), a4a86e4
    tile_major: bool = True  # TILED: weights stored tile-major, every TMA load one contiguous block (pack.py;
    # measured -1.7% (1B) / -2.3% (8B) against row-major at e2809b0, bench/NOTES.md)
    mma: int = 1  # matvec consumer: 1 tensor cores (matvec.dot_tile_mma: each tile-major [TR, TK] block loaded as a
    # folded [TR * TK / 32, 32] matrix; needs tile_major; measured -3.3% (1B) / -4.6% (8B) against 0 at bbc65b6);
    # 0 CUDA-core FMAs

    @classmethod
    def for_spec(cls, spec: ModelSpec, page_size: int = 16) -> "KernelConfig":
        """The default tiles, with 16-row tiles (16 x 512) when a head is too small for two 32-row tiles."""
        if spec.head_dim % (2 * cls.tile_rows):
            return cls(tile_rows=16, tile_k=512, page_size=page_size)
        return cls(page_size=page_size)

    def ring_slots(self, spec: ModelSpec) -> int:
        """NB: ``ring``, or (0) the most [TR, TK] slots that fit in an H100/H200 CTA's shared memory beside the
        staging buffer ``hbuf`` and the compiler's scratch (measured 4-8 KB: the default kernels of session 10 use
        184 KB for the 1B and 205 KB for the 8B at 10 slots): 12 for the Llama-1B shape, 11 for the 8B."""
        slot = self.tile_rows * self.tile_k * 2
        kv = 4 * attn_block(spec) * spec.head_dim * 2 if self.kv_pipeline else 0  # two stages of K and V
        xb = exchange_bytes(spec, self)  # the cluster pairs' exchange region (0 without them)
        xb += self.release_bytes(self.ring or 16)  # and the per-warp releases' empty barriers (at most 16 slots)
        xb += self.hold_bytes()  # and the release hold's count
        fit = (SHARED_BYTES - self.hbuf_rows(spec) * self.tile_k * 2 - SCRATCH_BYTES - kv - xb) // slot
        if self.ring > fit:
            raise ValueError(f"ring={self.ring} slots of {slot} bytes do not fit in shared memory ({fit} do)")
        if fit < 2:
            raise ValueError(f"shared memory holds {fit} ring slots of {slot} bytes; the ring needs 2")
        if self.warp_release:  # verified at 10 slots; at 12 and 13 it gave wrong logits on the H200 (session 22)
            if self.ring > WARP_RELEASE_SLOTS:
                raise ValueError(f"warp_release is correct on the GPU only up to {WARP_RELEASE_SLOTS} ring slots "
                                 f"(ring={self.ring}; bench/NOTES.md session 22)")
            return self.ring or min(fit, WARP_RELEASE_SLOTS)
        return self.ring or fit

    def smem_merge(self, spec: ModelSpec) -> bool:
        """AMERGE: ``attn_smem_merge`` in effect: the staging buffer holds the compute warps' attention states
        (o [num_warps, GP, head_dim], m and l [num_warps, GP], fp32), as attention._merge_smem asserts."""
        gp = _pow2(spec.group_size)
        need = self.num_warps * gp * (spec.head_dim + 2) * 4
        return self.attn_smem_merge and need <= self.hbuf_rows(spec) * self.tile_k * 2

    def compact_hbuf(self) -> bool:
        """XDC: ``half_hbuf`` in effect: with the DOWN_PROJ halves staging their own columns (``down_half_stage``
        and ``down_pairs()``)."""
        return self.half_hbuf and self.down_half_stage and self.down_pairs()

    def hbuf_rows(self, spec: ModelSpec) -> int:
        """KT_ROWS: the staging buffer's [TK] rows, the widest staged input's column tiles rounded up to a power of
        two: D, q_size or I, or with ``compact_hbuf()`` half of I's column tiles in place of I's."""
        kt = lambda k: -(-k // self.tile_k)  # noqa: E731
        widest = max(kt(spec.hidden_size), kt(spec.q_size))
        return _pow2(max(widest, -(-kt(spec.intermediate_size) // 2) if self.compact_hbuf()
                         else kt(spec.intermediate_size)))

    def release_bytes(self, slots: int) -> int:
        """WREL: bytes of dynamic shared memory for the per-warp releases' empty barriers (``warp_release``), one
        8-byte mbarrier a ring slot rounded up to 16; 0 without them."""
        return -(-8 * slots // 16) * 16 if self.warp_release else 0

    def hold_bytes(self) -> int:
        """HCNT: bytes of dynamic shared memory for the release hold's count (``hold_count``, with the hold on):
        one 32-bit word, 16 bytes; 0 otherwise."""
        return 16 if self.hold_count and self.quiet >= 0 else 0

    def region_bytes(self, spec: ModelSpec) -> int:
        """Dynamic shared memory past Triton's own: the release hold's count, the per-warp releases' barriers, then
        the cluster exchange region (the last bytes)."""
        return self.hold_bytes() + self.release_bytes(self.ring_slots(spec)) + exchange_bytes(spec, self)

    def held_ops(self) -> int:
        """QUIET_OPS: the bit mask (1 << isa.Op) of the ops whose instructions the release hold applies to."""
        ops = [isa.Op[name] for name in self.quiet_ops] or isa.STREAMING_OPS
        return sum(1 << int(op) for op in ops)

    def deep_cap(self, spec: ModelSpec) -> tuple[int, int]:
        """(DEEP, DEEP_OPS): ``inflight_deep`` and the bit mask (1 << isa.Op) of ``deep_ops``; (0, 0) where either is
        unset or the ring has no common cap (``inflight_cap`` 0: every op already has the whole ring)."""
        if not (self.inflight_deep and self.deep_ops and self.inflight_cap(spec)):
            return 0, 0
        return self.inflight_deep, sum(1 << int(isa.Op[name]) for name in self.deep_ops)

    def inflight_cap(self, spec: ModelSpec) -> int:
        """INFLIGHT: ``inflight``, or 0 (no cap beyond the ring) where the ring has no more slots than that."""
        return self.inflight if self.inflight < self.ring_slots(spec) else 0

    def tile_box(self) -> tuple[int, int]:
        """The TMA box (= ring slot shape) of one weight tile: [TR, TK], or with ``mma`` the same TR * TK elements of
        a tile-major block read as a row-major [TR * TK / 32, 32] matrix (matvec.dot_tile_mma)."""
        if self.mma:
            return self.tile_rows * self.tile_k // MMA_K, MMA_K
        return self.tile_rows, self.tile_k

    def clusters(self) -> int:
        """The cluster pairs' mode in effect: ``cluster_qkv``, or 0 where ATTN_IN has no two parts to pair (qkv_parts
        set to another count, or qkv_in_attn, whose parts have no finisher) and with the versioned words (opt-in,
        measured slower, and their kernels spill 4-24 bytes beside the exchange: they keep the tickets they were
        measured with)."""
        versioned = any(self.versioned().values())
        return 0 if self.qkv_in_attn or versioned or self.qkv_parts not in (0, 2) else self.cluster_qkv

    def down_pairs(self) -> bool:
        """XD: DOWN_PROJ's cluster pairs in effect: ``cluster_down`` where the cluster pairs run with asynchronous
        stores (``clusters()`` 2: not with tickets, release arrivals or versioned words), and neither O_PROJ parts
        (their x parts are summed in DOWN_PROJ's residual rows) nor merged releases (a half does not signal)."""
        return self.cluster_down and self.clusters() == 2 and not (self.o_parts or self.merge_signals)

    def for_launch(self, spec: ModelSpec, num_sms: int) -> "KernelConfig":
        """This config as one launch on ``num_sms`` SMs runs it: without cluster pairs where none can form (an odd
        SM count, or a hidden size of fewer than two column tiles to split a head over), and with the staging
        buffer sized for a whole DOWN_PROJ where the program has one unpaired (``half_hbuf``: the 8B's 128 row
        blocks on 132 SMs, the 1B's 64 on fewer than 128)."""
        kcfg = self
        if kcfg.clusters() and (num_sms % 2 or -(-spec.hidden_size // kcfg.tile_k) < 2):
            kcfg = dataclasses.replace(kcfg, cluster_qkv=0)
        if kcfg.compact_hbuf():  # the pairing depends on the row blocks and the SMs, not on the context
            program = build_program(spec, StepShape((1,), 1), num_sms, kcfg.program_config())
            if not down_halves_only(program):
                kcfg = dataclasses.replace(kcfg, half_hbuf=False)
        return kcfg

    def versioned(self) -> dict[str, bool]:
        """Which scratch buffers the kernel takes as versioned words (int64 ``<name>_words``, state.py) rather
        than fp32 ``<name>``: one place for the kernel's argument types and the decoder's buffers."""
        return {"x": self.flag_x, "q": self.flag_q, "attn": self.flag_attn, "act": self.flag_act}

    def program_config(self) -> ProgramConfig:
        return ProgramConfig(tile_rows=self.tile_rows, tile_k=self.tile_k, qkv_parts=self.qkv_parts,
                             min_split_tokens=self.min_split_tokens,
                             combine_splits=self.combine_splits, fixed_cost_bytes=self.fixed_cost_kb * 1024,
                             max_block_bytes=self.max_block_kb * 1024, signal_logits=self.signal_logits,
                             flag_act=self.flag_act, flag_x=self.flag_x, flag_attn=self.flag_attn,
                             flag_q=self.flag_q, qkv_in_attn=self.qkv_in_attn, merge_signals=self.merge_signals,
                             o_parts=self.o_parts, cluster_qkv=bool(self.clusters()),
                             cluster_down=self.down_pairs())

    def check(self, spec: ModelSpec) -> None:
        tr = self.tile_rows
        if spec.head_dim % (2 * tr):
            raise ValueError(f"head_dim {spec.head_dim} must be a multiple of 2*tile_rows ({2 * tr})")
        for name in ("hidden_size", "intermediate_size", "vocab_size"):
            if getattr(spec, name) % tr:
                raise ValueError(f"{name}={getattr(spec, name)} must be a multiple of tile_rows={tr}")
        if self.tile_k % (32 * self.num_warps):
            raise ValueError("tile_k must be a multiple of 32 * num_warps")
        self.ring_slots(spec)  # raises if the ring does not fit (beside the kv_pipeline's stages)
        streaming = [op.name for op in isa.STREAMING_OPS]
        if not set(self.quiet_ops) <= set(streaming):
            raise ValueError(f"quiet_ops={self.quiet_ops}: the hold applies to streaming ops only, {streaming}")
        if not set(self.deep_ops) <= set(streaming):
            raise ValueError(f"deep_ops={self.deep_ops}: the in-flight cap applies to streaming ops only, {streaming}")
        if self.warp_release and not (self.mma and self.tile_major):
            raise ValueError("warp_release: the per-warp releases are built for the tensor-core consumer (mma=1)")
        if not 0 <= self.inflight_deep < self.ring_slots(spec):
            raise ValueError(f"inflight_deep={self.inflight_deep}: 0 (off) or a cap under the ring's "
                             f"{self.ring_slots(spec)} slots")
        if self.quiet < -1:
            raise ValueError(f"quiet={self.quiet}: -1 (off) or the tiles an instruction may request before the release")
        if self.inflight < 0:
            raise ValueError(f"inflight={self.inflight}: 0 (the whole ring) or a positive cap")
        if self.vprobe not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"vprobe={self.vprobe}: 1 (spin on the missing words) or a power-of-two probe stride "
                             "up to 256")
        if not 0 <= self.qkv_parts <= 8:
            raise ValueError(f"qkv_parts={self.qkv_parts}: 0 (the cost model's choice, at most 8) or 1..8 (the "
                             "finisher's unrolled sum, matvec.MAX_PARTS)")
        pcfg = self.program_config()
        pcfg.check()  # flag_attn needs flag_x; qkv_in_attn excludes flag_q
        pcfg.check_spec(spec)  # o_parts: whole KV groups and column tiles a part
        if self.o_parts and spec.group_size & (spec.group_size - 1):
            raise ValueError(f"o_parts: the kernel stages whole groups of a power-of-two number of heads, "
                             f"not {spec.group_size}")
        if self.cluster_qkv not in (0, 1, 2):
            raise ValueError(f"cluster_qkv={self.cluster_qkv}: 0 (tickets), 1 (remote stores and release arrivals) or "
                             "2 (asynchronous remote stores)")
        if self.clusters() == 2 and self.tile_rows > 32:
            raise ValueError("cluster_qkv=2 stores a row tile from one owner thread an element: tile_rows <= 32")
        if self.mma not in (0, 1):
            raise ValueError(f"mma={self.mma}: 0 (CUDA cores) or 1 (tensor cores)")
        if self.mma:
            if not self.tile_major:
                raise ValueError("mma needs tile-major weights (tile_major=True)")
            folds = self.tile_k // MMA_K
            if self.tile_k % MMA_K or folds % 8 or (tr * folds) % (16 * self.num_warps):
                raise ValueError(f"mma: a [{tr}, {self.tile_k}] tile does not fold into {self.num_warps} warps' "
                                 f"16-row mma blocks with a multiple of 8 folds of {MMA_K}")
        wr = min(self.num_warps, tr // 4)
        if self.num_warps % wr or self.tile_k % (64 * (self.num_warps // wr)):
            raise ValueError(f"{self.num_warps} warps cannot tile a [{tr}, {self.tile_k}] weight tile")


MMA_K = 32  # columns of a folded tile row (matvec.dot_tile_mma): two k16 steps of mma.sync
SHARED_BYTES = 232448  # the most dynamic shared memory one CTA may use on sm_90 (227 KB)
WARP_RELEASE_SLOTS = 10  # the deepest ring the per-warp releases (KernelConfig.warp_release) ran correctly with:
# at 12 and 13 slots (the default depth since session 21) SmolLM2's and the 1B's logits were wrong on every run,
# at 10 right on every run (session 22, cause not yet found; bench/NOTES.md)
SCRATCH_BYTES = 8 * 1024  # kept for the compiler's own shared scratch (layout conversions, reductions, barriers):
# ~4.3 KB in the default kernels (session 21: Triton's shared memory less the ring and the staging buffer); 10 KB
# until session 21 gave no kernel in variants.py another slot at 8 KB. Every kernel the compile tests build is
# checked to fit (test_kernel_compile._assert_fits_shared)


def attn_block(spec: ModelSpec) -> int:
    """BT: positions in one attention block (8 KB of K at bf16: 64 for head_dim 64, 32 for 128)."""
    return max(8, 4096 // spec.head_dim)


def down_halves_only(program: Program) -> bool:
    """Whether every DOWN_PROJ of ``program`` is a cluster pair's half: what the staging buffer sized for the
    halves (``KernelConfig.half_hbuf``) can stage; the scheduler pairs none where the row blocks are more than
    half the SMs."""
    return all(ins.n_parts == 2 for ins in program.instructions() if isinstance(ins, isa.DownProj))


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def parse_options(text: str) -> dict:
    """``"inflight=4,flag_act=1"`` -> ``{"inflight": 4, "flag_act": True}``: KernelConfig fields to override, typed
    from the dataclass (ints; booleans as 1/0/true/false; tuples as names joined by '+'). Unknown names and bad
    values raise ValueError naming what is accepted. The empty string is no override."""
    from dataclasses import fields

    types = {f.name: f.type for f in fields(KernelConfig)}
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
        elif str(types[name]).startswith("tuple"):  # names joined by '+': quiet_ops=MLP_IN+DOWN_PROJ
            out[name] = tuple(v.strip() for v in value.split("+") if v.strip())
        else:
            try:
                out[name] = int(value)
            except ValueError:
                raise ValueError(f"megakernel option {name}={value!r}: expected an integer") from None
    return out


def exchange_bytes(spec: ModelSpec, kcfg: KernelConfig) -> int:
    """XB: the bytes of dynamic shared memory past Triton's own that the cluster pairs exchange through (0: no
    cluster pairs, the kernel launched one CTA at a time)."""
    if not kcfg.clusters():
        return 0
    from .cluster import pair_region_bytes  # device code: imported only where clusters are asked for

    return pair_region_bytes(spec.head_dim)


def constexprs(spec: ModelSpec, kcfg: KernelConfig, max_splits: int) -> dict:
    kcfg.check(spec)
    return dict(
        D=spec.hidden_size, HQ=spec.num_heads, HKV=spec.num_kv_heads, HD=spec.head_dim,
        I=spec.intermediate_size, PS=kcfg.page_size, HAS_BIAS=spec.attention_bias, QK_NORM=spec.qk_norm,
        TR=kcfg.tile_rows, TK=kcfg.tile_k, NB=kcfg.ring_slots(spec), KT_ROWS=kcfg.hbuf_rows(spec),
        BT=attn_block(spec), SP2=_pow2(max_splits), GP=_pow2(spec.group_size),
        WR=min(kcfg.num_warps, kcfg.tile_rows // 4),
        # staging group: SG column tiles loaded at once, 32 fp32 registers a thread
        SG=min(kcfg.hbuf_rows(spec), 4096 // kcfg.tile_k),
        LOADER_REGS=kcfg.loader_regs, TILED=kcfg.tile_major, INFLIGHT=kcfg.inflight_cap(spec), QUIET=kcfg.quiet,
        QUIET_EARLY=kcfg.quiet_early, QUIET_OPS=kcfg.held_ops(), HMARK=kcfg.hold_marks and kcfg.quiet >= 0,
        **dict(zip(("DEEP", "DEEP_OPS"), kcfg.deep_cap(spec))),
        WREL=kcfg.release_bytes(kcfg.ring_slots(spec)), HCNT=bool(kcfg.hold_bytes()), ROW1=kcfg.attn_row,
        XDS=kcfg.down_half_stage and kcfg.down_pairs(), XDC=kcfg.compact_hbuf(), AMERGE=kcfg.smem_merge(spec),
        # the versioned stagings' flags carry their probe stride (versioned.wait's PROBE): 0 off, else vprobe
        DISPATCH=kcfg.dispatch, FLAG_ACT=kcfg.flag_act * kcfg.vprobe, FLAG_X=kcfg.flag_x * kcfg.vprobe,
        FLAG_ATTN=kcfg.flag_attn * kcfg.vprobe, FLAG_Q=kcfg.flag_q, QKV_IN_ATTN=kcfg.qkv_in_attn,
        MERGE=kcfg.merge_signals, KVP=kcfg.kv_pipeline, O_PARTS=kcfg.o_parts, SHFL=kcfg.fold_shuffle,
        NL=spec.num_layers, XB=exchange_bytes(spec, kcfg), XA=kcfg.clusters() == 2, XD=kcfg.down_pairs(),
        TRACE=kcfg.trace, TRACE_TILES=kcfg.trace_tiles,
        num_warps=kcfg.num_warps,
    )


def compile_sm90a(spec: ModelSpec, kcfg: KernelConfig = KernelConfig(), max_splits: int = 16):
    """Compile the megakernel for sm_90a without a GPU as ``kcfg.for_launch(spec, 132)`` (the kernel a decoder on
    an H100 or H200 builds); returns triton's CompiledKernel (``.asm['ptx']``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from .kernel import megakernel

    kcfg = kcfg.for_launch(spec, 132)  # as the decoder launches it on an H100's or H200's 132 SMs
    ce = constexprs(spec, kcfg, max_splits)
    box = list(kcfg.tile_box())
    lay = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    desc = f"tensordesc<bf16[{box[0]}, {box[1]}],{lay!r}>"
    bias_t = "*fp32"
    sig = {
        "prog_ptr": "*i32", "qlen_ptr": "*i32", "MAXLEN": "i32", "tok_ptr": "*i32", "pos_ptr": "*i32",
        "ctx_ptr": "*i32", "bt_ptr": "*i32", "MAXP": "i32", "cnt_ptr": "*i32", "NCNT": "i32",
        "rdy_ptr": "*i32",
        "d_qkv": desc, "d_o": desc, "d_gu": desc, "d_down": desc, "d_lm": desc,
        "emb_ptr": "*bf16", "anorm_ptr": "*bf16", "mnorm_ptr": "*bf16", "fnorm_ptr": "*bf16", "bias_ptr": bias_t,
        "qn_ptr": "*bf16", "kn_ptr": "*bf16", "invf_ptr": "*fp32", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "NP": "i32",
        "x_ptr": "*fp32", "qkvp_ptr": "*fp32", "q_ptr": "*fp32", "po_ptr": "*fp32", "pml_ptr": "*fp32",
        "attn_ptr": "*fp32", "act_ptr": "*fp32", "logits_ptr": "*fp32", "xp_ptr": "*fp32", "SPLITS": "i32",
        "eps": "fp32", "qscale": "fp32", "trace_ptr": "*i64", "tiles_ptr": "*i64", "MAXT": "i32",
    }
    sig.update({f"{name}_ptr": "*i64" for name, words in kcfg.versioned().items() if words})
    # every pointer 16-byte aligned, as the launch specializes torch's allocations (cp.async needs it to move
    # 16-byte vectors, and the loads vectorize as they do on the GPU)
    aligned = {(megakernel.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
               if v.startswith("*")}
    sig.update({k: "constexpr" for k in ce})
    src = GluonASTSource(megakernel, sig, ce, aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": kcfg.num_warps})




def ptxas_report(ptx: str) -> dict:
    """Assemble ``ptx`` for sm_90a with the ptxas shipped in the triton wheel; registers, stack and spills."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    num = lambda pat: int(re.search(pat, out).group(1))  # noqa: E731
    return dict(registers=num(r"Used (\d+) registers"), stack=num(r"(\d+) bytes stack frame"),
                spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"))
