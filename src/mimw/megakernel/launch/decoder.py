"""MegakernelDecoder: plans the step once, owns the packed weights, step state and scratch, and runs one decode
step per launch of the persistent megakernel, optionally captured in a CUDA graph.

    dec = MegakernelDecoder(weights, cache)                # weights: ModelWeights; cache: PagedKVCache on cuda,
                                                          # bf16 or fp8 (e4m3 + a bf16 scale per row, kv/pages.py)
    logits = dec.step(token, position, block_table)       # [1, V] fp32, a view into the scratch buffer
    logits = dec.step_batch(tokens, positions, tables)    # [B, V]: B sequences' next tokens in one launch
    logits, rows = dec.step_segments(tokens, segments)    # [M, V]: decode tokens and verify blocks, M tokens in all
With ``use_graph=True`` the first ``step`` captures a CUDA graph (after filling the state) and later steps replay it.
``step_batch`` (B = 2..plan.max_tokens: 32, the 8B shapes 16) runs a decode batch: one token of each of B sequences,
the weights streamed once (swap-AB wgmma, device/matvec_mt.py). ``step_segments`` runs any segments of M tokens in
all (verify blocks included) as M one-token segments (one_token.py) whose attention runs each verify block as one
query block. Each M and layout of query blocks has its own plan, step state, scratch and graph (one program each,
built on first use; the compiled kernel is shared where the constants agree); all share the packed weights. The
``MAX_DECODERS`` layouts used last are kept (a layout's decoder holds ~10-30 MB, the logits rows the most; serving
with verify blocks of varied lengths would otherwise keep every layout it ever saw).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from types import SimpleNamespace
from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.reference import Segment
from ...models.weights import ModelWeights
from ..plan import KV_DTYPES, LaunchPlan, Tuning, min_query_block, plan
from ..program import StepShape
from ..state import alloc_scratch, alloc_state, counter_slots, split_slots, unspecialized
from ..tensor_parallel import TensorParallel, shard_weights
from .. import isa
from . import args
from .one_token import split_segments
from .pack import pack


# a MegakernelDecoder keeps the decoders of the last MAX_DECODERS layouts (tokens, query blocks) it ran: every decode
# bucket (six at most) and the verify layouts in use
MAX_DECODERS = 32


class MegakernelDecoder:
    def __init__(self, weights: ModelWeights, cache: PagedKVCache, max_pages_per_seq: int | None = None,
                 tuning: Tuning = Tuning(), num_sms: int | None = None, context_hint: int = 1024,
                 use_graph: bool = False, batch: int = 1, packed=None, blocks: tuple[int, ...] = (),
                 tp: tuple[int, int] = (0, 1)):
        """``batch``: tokens a step (one of each of ``batch`` sequences); ``blocks``: attention's query blocks of
        those one-token segments (program.StepShape.attn_blocks; () : every token its own); ``packed``: another
        decoder's packed weights and descriptor to share (``step_batch``'s decoders); ``tp``: (rank, ranks) of
        tensor parallelism: the decoder of that rank, over the whole model's ``weights`` (it packs its shard) and
        the rank's ``cache`` shard (tensor_parallel.shard_cache); its launches wait on the peers it is ``link``-ed
        to (launch/tp.py)."""
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        spec = weights.spec
        if cache.layout.dtype not in KV_DTYPES or cache.device.type != "cuda":
            raise ValueError(f"the megakernel needs a bf16 or fp8 KV cache on a CUDA device, got "
                             f"{cache.layout.describe()} on {cache.device}")
        dev = cache.device
        self.whole_spec, self.cache, self.use_graph, self.tp = spec, cache, use_graph, tp
        self.num_sms = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
        self.max_pages = max_pages_per_seq or cache.layout.num_pages
        self.shape = StepShape((1,) * batch, context_hint, blocks)
        self.plan = plan(spec, self.num_sms, self.shape, cache.layout.page_size, tuning, cache.layout.dtype, tp)
        self.spec = self.plan.spec  # the model the kernel runs: the rank's shard under tensor parallelism
        if cache.layout.num_kv_heads != self.spec.num_kv_heads:
            raise ValueError(f"rank {tp[0]} of {tp[1]} holds {self.spec.num_kv_heads} KV heads; the cache has "
                             f"{cache.layout.num_kv_heads} (tensor_parallel.shard_cache gives a rank's cache)")
        # tensor parallelism: every rank's inbox buffer and counter table ([ranks] int64 addresses: ``link``) and
        # this rank's number; one-element dummies that a one-GPU kernel never reads
        dummy = torch.zeros(1, dtype=torch.int64, device=dev)
        self.peers: tuple = (dummy, dummy, torch.tensor([tp[0]], dtype=torch.int32, device=dev))
        # a bf16 cache has no scales: the kernel's scale arguments get a one-element dummy it never reads
        none = torch.ones(1, dtype=torch.bfloat16, device=dev)
        self.scales = (cache.k_scale, cache.v_scale) if cache.layout.quantized else (none, none)
        self._tuning = tuning
        # (tokens, query blocks) -> that step's decoder, least recently used first (at most MAX_DECODERS)
        self._batches: OrderedDict[tuple[int, tuple[int, ...]], MegakernelDecoder] = OrderedDict()
        if packed is not None:
            self.w, self.desc = packed
        else:
            if tp[1] > 1:
                weights = shard_weights(weights, TensorParallel(spec, *tp, self.plan.tuning.tile_rows))
            self.w = pack(weights, self.plan.program.tiles, dev)
            box = args.tile_box(self.plan.tuning.tile_rows, self.plan.tuning.tile_k)
            self.desc = TensorDescriptor.from_tensor(self.w.tiles, box,
                                                     gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))
        # cluster pairs: each CTA's word moves to epoch + 1 once its exchange barriers exist in a launch (never
        # reset, like the counters); unused otherwise
        self.ready_words = torch.zeros(self.num_sms, dtype=torch.int32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs_set = False
        self.cluster_fallback: str | None = None  # why the cluster pairs fell back to tickets on this GPU, if they did
        self._allocate()
        if self.plan.cluster_size > 1:
            why = self._set_up_clusters()
            if why is not None:  # a persistent kernel whose CTAs are not all resident would wait forever
                warnings.warn(f"{why}: the megakernel runs with tickets instead of cluster pairs", RuntimeWarning,
                              stacklevel=2)
                self.cluster_fallback = why
                self.plan = plan(spec, self.num_sms, self.shape, cache.layout.page_size,
                                 dataclasses.replace(tuning, clusters=False), cache.layout.dtype, tp)
                self._allocate()

    def _kv_descs(self) -> tuple:
        """TMA descriptors of the K and V pools as [rows, head_dim] (one row a position of one KV head of one page of
        one layer), box [KVBOX, head_dim]: the loader's K/V stream (device/kv_stream.py)."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        c, fp8 = self.plan.constants, self.cache.layout.quantized
        box, lay = [c.KVBOX, c.HD], args.kv_layout(fp8)
        return tuple(TensorDescriptor.from_tensor(pool.view(-1, c.HD), box, lay)
                     for pool in (self.cache.k, self.cache.v))

    def _allocate(self) -> None:
        """The plan's words, K/V descriptors, step state, scratch and trace buffer."""
        p, dev = self.plan, self.cache.device
        # the queue length the kernel strides by, padded with NOP words to one the JIT does not specialize
        pad = unspecialized(p.words.shape[1]) - p.words.shape[1]
        nop = torch.tensor(isa.Nop().encode(), dtype=torch.int32).expand(p.words.shape[0], pad, -1)
        self.words, self.lens = torch.cat([p.words, nop], dim=1).to(dev), p.lens.to(dev)
        self.kv_descs = self._kv_descs()
        self.state = alloc_state(p.program, self.max_pages, dev)
        self.scratch = alloc_scratch(p.program, dev)
        self._stand_ins: dict[torch.dtype, torch.Tensor] = {}  # one-element stand-ins for empty scratch (_nonempty)
        # when traced (tools/trace.py), else 1-element dummies: [num_sms, max_len, 4] int64 ns per instruction, and
        # the loaders' routing waits [num_sms, num_layers, 2] (device/route_wait.py; zeros where an SM waits on no
        # routing entry of a layer)
        self.trace = torch.zeros((self.num_sms, self.words.shape[1], 4) if p.tuning.trace else (1,),
                                 dtype=torch.int64, device=dev)
        self.wait_trace = torch.zeros((self.num_sms, self.spec.num_layers, 2) if p.tuning.trace else (1,),
                                      dtype=torch.int64, device=dev)

    @property
    def program(self):
        return self.plan.program

    def _args(self) -> tuple:
        s, x, w, c, p = self.state, self.scratch, self.w, self.cache, self.plan
        return args.values(dict(
            words=self.words, lens=self.lens, max_len=self.words.shape[1], tokens=s.tokens, positions=s.positions,
            seg_ctx=s.seg_ctx, seg_new=s.seg_new, block_tables=s.block_tables, max_pages=s.block_tables.shape[1],
            counters=s.counters,
            num_counters=counter_slots(p.program), ready=self.ready_words, weights=self.desc, embed=w.embed,
            attn_norm=w.attn_norm, mlp_norm=w.mlp_norm, final_norm=w.final_norm, bias=w.bias, q_norm=w.q_norm,
            k_norm=w.k_norm, inv_freq=w.inv_freq, k=c.k, v=c.v, k_scale=self.scales[0], v_scale=self.scales[1],
            num_pages=c.layout.num_pages, k_desc=self.kv_descs[0], v_desc=self.kv_descs[1], x=x.x,
            qkv_part=x.qkv_part, q=x.q, part_o=x.part_o, part_ml=x.part_ml,
            attn=x.attn, act=x.act, logits=x.logits, splits=split_slots(p.program), x16=x.x16, attn16=x.attn16,
            act16=x.act16, router_logits=self._nonempty(x.router_logits), routed=self._nonempty(x.routed),
            slot_w=self._nonempty(x.slot_w), moe_act=self._nonempty(x.moe_act), moe_part=self._nonempty(x.moe_part),
            moe_act16=self._nonempty(x.moe_act16),
            eps=self.spec.rms_norm_eps,
            qscale=self.spec.head_dim ** -0.5 * 1.4426950408889634, stamps=self.trace, waits=self.wait_trace,
            peer_boxes=self.peers[0], peer_counters=self.peers[1], peer_rank=self.peers[2]))

    def link(self, boxes: torch.Tensor, counters: torch.Tensor) -> None:
        """Tensor parallelism: every rank's inbox buffer and counter table as [ranks] int64 device addresses (rank
        order; launch/tp.py), which this rank's kernel sends its partials and signals to. Before the first launch
        (a captured graph keeps the tables' addresses, not their contents)."""
        ranks = self.tp[1]
        for name, t in (("boxes", boxes), ("counters", counters)):
            if t.shape != (ranks,) or t.dtype != torch.int64 or t.device != self.cache.device:
                raise ValueError(f"{name}: need [{ranks}] int64 addresses on {self.cache.device}, got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")
        self.peers = (boxes, counters, self.peers[2])

    def _nonempty(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, or where it is empty (a dense model's MoE scratch, never read) a one-element stand-in of its dtype:
        a kernel pointer argument must address device memory."""
        if t.numel():
            return t
        if t.dtype not in self._stand_ins:
            self._stand_ins[t.dtype] = torch.zeros(1, dtype=t.dtype, device=t.device)
        return self._stand_ins[t.dtype]

    def _set_up_clusters(self) -> str | None:
        """Compile the kernel (the JIT's cached kernel of this specialization, which every later launch finds), set
        it to launch in clusters of two CTAs with the exchange region past Triton's shared memory, and check that
        the GPU keeps every cluster resident. Returns None, or why it cannot run here."""
        from ..device.kernel import megakernel
        from .clusters import in_clusters, max_active_clusters

        p = self.plan
        compiled = in_clusters(megakernel.warmup(*self._args(), grid=(p.grid,), C=p.constants,
                                                 num_warps=p.constants.NW), 2, p.exchange_bytes)
        compiled._init_handles()  # load it: the occupancy query needs the CUfunction
        num_warps, _, smem = compiled.packed_metadata
        fit = max_active_clusters(compiled.function, 2, 32 * num_warps, smem)
        if fit < p.grid:
            return (f"{fit} clusters of two fit this GPU at {smem} bytes of shared memory, the kernel needs "
                    f"{p.grid} resident ({self.num_sms} SMs)")
        return None

    def compile(self) -> None:
        """Compile this decoder's kernel without launching it (the JIT's cached kernel of this specialization, which
        every later launch finds; at once where the cluster set-up compiled it already)."""
        from ..device.kernel import megakernel

        p = self.plan
        megakernel.warmup(*self._args(), grid=(p.grid,), C=p.constants, num_warps=p.constants.NW)

    def set_inputs(self, token: int, position: int, block_table: Sequence[int]) -> None:
        self.set_batch([token], [position], [block_table])

    def set_batch(self, tokens: Sequence[int] | torch.Tensor, positions: Sequence[int],
                  block_tables: Sequence[Sequence[int]], firsts: Sequence[int] | None = None) -> None:
        """One token a segment: its id (host ints, or a tensor: a device tensor is never read on the host), its
        position and its sequence's block table, and (default: its position) the first position the step writes in
        its sequence (state.seg_new); as many as the plan's tokens."""
        if not len(tokens) == len(positions) == len(block_tables) == self.shape.num_tokens:
            raise ValueError(f"this decoder runs {self.shape.num_tokens} token(s) a step, got {len(tokens)} tokens, "
                             f"{len(positions)} positions, {len(block_tables)} block tables")
        toks = tokens if isinstance(tokens, torch.Tensor) else list(tokens)  # a device tensor stays on the device
        self.state.fill(toks, list(positions), list(block_tables), self.shape.seg_lens,
                        None if firsts is None else list(firsts))
        self.inputs_set = True

    def launch(self) -> None:
        """One decode step with the current step state. The state must hold a real step: a launch on an empty state
        would append K/V for position 0 through page 0 of the (zeroed) block table, overwriting a live page."""
        from ..device.kernel import megakernel

        if not self.inputs_set:
            raise RuntimeError("set_inputs() must be called before the first launch")
        p = self.plan
        megakernel[(p.grid,)](*self._args(), C=p.constants, num_warps=p.constants.NW)

    def capture(self) -> None:
        """Record one launch in a CUDA graph; later ``run``/``step`` calls replay it. The warm-up launch before the
        capture (compilation) executes the step currently in the state, so call ``set_inputs`` first; re-running a
        step is harmless (it rewrites the same K/V row and scratch)."""
        self.launch()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.launch()
        self.graph = g

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.launch()

    def step(self, token: int, position: int, block_table: Sequence[int]) -> torch.Tensor:
        self.set_inputs(token, position, block_table)
        if self.use_graph and self.graph is None:
            self.capture()  # lazily, with this real step in the state
        self.run()
        return self.scratch.logits

    def batch_decoder(self, batch: int, blocks: tuple[int, ...] = ()) -> "MegakernelDecoder":
        """The decoder of ``batch`` tokens a step in attention query blocks ``blocks`` (self for this one's shape),
        sharing this one's packed weights and cache; built on first use."""
        if (batch, blocks) == (self.shape.num_tokens, self.shape.attn_blocks):
            return self
        key = (batch, blocks)
        dec = self._batches.get(key)
        if dec is not None:
            self._batches.move_to_end(key)
            return dec
        if len(self._batches) >= MAX_DECODERS:  # the least recently used layout goes, once the GPU is past its
            # launches: its graph's and scratch's memory must not be handed out under a replay still in flight
            torch.cuda.synchronize(self.cache.device)
            self._batches.popitem(last=False)
        # with the packed weights given, the constructor reads only the weights' spec: no reference to the caller's
        # weights is kept
        dec = self._batches[key] = MegakernelDecoder(
            SimpleNamespace(spec=self.whole_spec), self.cache, self.max_pages, self._tuning, self.num_sms,
            self.shape.context_hint, self.use_graph, batch=batch, packed=(self.w, self.desc), blocks=blocks, tp=self.tp)
        return dec

    def warm_bucket(self, batch: int, pad_page: int) -> None:
        """Run the decode program of ``batch`` tokens once on ``pad_page`` alone (``batch`` padding rows, each at
        position 0 of that page, the rows a padded decode batch adds: one_token.split_segments) and capture its CUDA
        graph, so that a decode batch of any size of that bucket replays it (``MegakernelBackend.prepare``)."""
        self._run_batch([0] * batch, [0] * batch, [(pad_page,)] * batch, [0] * batch)

    def forget(self, batch: int, blocks: tuple[int, ...] = ()) -> None:
        """Drop the decoder ``batch_decoder(batch, blocks)`` built (its state, scratch and graph; the compiled kernel
        stays with the JIT)."""
        self._batches.pop((batch, blocks), None)

    def step_batch(self, tokens: Sequence[int], positions: Sequence[int],
                   block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """A decode batch in one launch: token b of sequence b at ``positions[b]`` through ``block_tables[b]``
        (B = 1..plan.max_tokens sequences, each page that receives a new row private to its sequence). Returns
        logits [B, V] fp32, a view into that batch decoder's scratch."""
        return self._run_batch(tokens, positions, block_tables, None)

    def segments_decoder(self, segments: Sequence[Segment], pad_page: int | None = None) -> "MegakernelDecoder":
        """The decoder ``step_segments`` runs these segments on (their bucket's tokens in their query blocks)."""
        one = self._one_token(segments, pad_page)
        return self.batch_decoder(one.num_tokens, one.blocks)

    def _one_token(self, segments: Sequence[Segment], pad_page: int | None):
        """``segments`` as this cache's one-token step (its page size; query blocks from ``plan.min_query_block`` of
        its element type)."""
        return split_segments(segments, pad_page, self.cache.layout.page_size, min_query_block(self.cache.layout.dtype))

    def step_segments(self, tokens: Sequence[int] | torch.Tensor, segments: Sequence[Segment],
                      pad_page: int | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Any segments (decode tokens, verify blocks; M = 2..plan.max_tokens tokens in all, concatenated in segment
        order; one segment a sequence) in one launch, as one-token segments (one_token.py); with ``pad_page`` (a page
        of the cache no sequence owns) padded to the bucket of M tokens, so that a bucket's plan, kernel and graph
        serve all its M. Returns (the logits of every token the step ran [N, V] fp32, the segments' first: a view
        into that decoder's scratch; the rows of it the segments' ``num_logits`` ask for, in segment order)."""
        one = self._one_token(segments, pad_page)
        if isinstance(tokens, torch.Tensor):  # on the device: padded there (any id: the padding's logits are unread)
            tokens = torch.cat([tokens.reshape(-1), tokens.new_zeros(one.padding)])
        else:
            tokens = list(tokens) + [0] * one.padding
        return self._run_batch(tokens, one.positions, one.block_tables, one.firsts, one.blocks), one.logit_rows

    def _run_batch(self, tokens, positions, block_tables, firsts, blocks: tuple[int, ...] = ()) -> torch.Tensor:
        dec = self.batch_decoder(len(tokens), blocks)
        dec.set_batch(tokens, positions, block_tables, firsts)
        if dec.use_graph and dec.graph is None:
            dec.capture()
        dec.run()
        return dec.scratch.logits


__all__ = ["MegakernelDecoder", "LaunchPlan"]
