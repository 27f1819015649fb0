"""MegakernelDecoder: plans the step program once, owns the packed weights, step state and scratch, and runs one
decode step (M = 1) per launch of the persistent megakernel — optionally captured in a CUDA graph.

    dec = MegakernelDecoder(weights, cache)                # weights: ModelWeights; cache: PagedKVCache (bf16, cuda)
    logits = dec.step(token, position, block_table)       # [1, V] fp32, a view into the scratch buffer
With ``use_graph=True`` the first ``step`` captures a CUDA graph (after filling the state) and later steps replay it.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.weights import ModelWeights
from ..program import StepShape, build_program
from ..state import alloc_scratch, alloc_state
from .config import KernelConfig, constexprs, down_halves_only
from .hold import check_marks, hold_marks, mark_words
from .pack import pack
from .orchestration import TRACE_STAMPS
from .trace import tile_counts


class MegakernelDecoder:
    def __init__(self, weights: ModelWeights, cache: PagedKVCache, max_pages_per_seq: int | None = None,
                 kcfg: KernelConfig | None = None, num_sms: int | None = None, context_hint: int = 1024,
                 use_graph: bool = False):
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        spec = weights.spec
        kcfg = kcfg or KernelConfig.for_spec(spec, cache.layout.page_size)
        if kcfg.page_size != cache.layout.page_size:
            raise ValueError(f"kernel page_size {kcfg.page_size} != cache page_size {cache.layout.page_size}")
        if cache.layout.dtype != torch.bfloat16 or cache.device.type != "cuda":
            raise ValueError("the megakernel needs a bf16 KV cache on a CUDA device")
        dev = cache.device
        self.spec, self.cache, self.use_graph = spec, cache, use_graph
        self.num_sms = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
        self.max_pages = max_pages_per_seq or cache.layout.num_pages
        kcfg = kcfg.for_launch(spec, self.num_sms)  # no cluster pairs where none can form
        self.w = pack(weights, kcfg.tile_rows, dev, kcfg.tile_k if kcfg.tile_major else None)
        box = list(kcfg.tile_box())  # [TR, TK], or a tile-major block's bytes as [TR * TK / 32, 32] (mma)
        lay = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
        self.descs = [TensorDescriptor.from_tensor(t.view(-1, box[1]) if kcfg.mma else t, box, lay)
                      for t in (self.w.qkv, self.w.o, self.w.gu, self.w.down, self.w.lm)]
        # cluster pairs (KernelConfig.cluster_qkv): each CTA's word moves to epoch + 1 once its exchange barriers
        # exist in a launch (kernel.py; never reset, like the counters); unused otherwise
        self.ready_words = torch.zeros(self.num_sms, dtype=torch.int32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs_set = False
        self.cluster_fallback: str | None = None  # why the cluster pairs fell back to tickets on this GPU, if they did
        self._plan(kcfg, context_hint)
        if self.ce["XB"]:
            why = self._set_up_clusters()
            if why is not None:  # a persistent kernel whose CTAs are not all resident would wait forever
                warnings.warn(f"{why}: the megakernel runs with tickets (KernelConfig(cluster_qkv=0)) instead",
                              RuntimeWarning, stacklevel=2)
                self.cluster_fallback = why
                self._plan(dataclasses.replace(kcfg, cluster_qkv=0), context_hint)
        if (self.ce["WREL"] or self.ce["HCNT"]) and not self.ce["XB"]:  # the region past Triton's without clusters
            self._compile_for_launch(1)  # (the per-warp releases' barriers, the release hold's count)

    def _plan(self, kcfg: KernelConfig, context_hint: int) -> None:
        """The step program for ``kcfg``, its step state and scratch, the kernel's constexprs and trace buffers
        (everything that depends on the cluster pairs; the packed weights do not)."""
        dev = self.cache.device
        self.kcfg = kcfg
        self.program = build_program(self.spec, StepShape((1,), context_hint), self.num_sms, kcfg.program_config())
        if kcfg.compact_hbuf() and not down_halves_only(self.program):  # KernelConfig.for_launch rules it out
            raise RuntimeError("the staging buffer sized for DOWN_PROJ's halves (half_hbuf) cannot stage the "
                               "unpaired DOWN_PROJ of this program: plan with KernelConfig.for_launch")
        words, lens = self.program.encode()
        if kcfg.hold_marks:  # the release hold's marks (gpu/hold.py): which releases compute announces
            marks = hold_marks(self.program, kcfg)
            check_marks(marks)
            words = mark_words(words, marks)
        self.words, self.lens = words.to(dev), lens.to(dev)
        self.state = alloc_state(self.program, self.max_pages, dev)
        self.scratch = alloc_scratch(self.program, dev)
        # x, q, attn, act as the kernel takes them: fp32, or the int64 versioned words (KernelConfig.versioned)
        self.versioned_buffers = {name: getattr(self.scratch, f"{name}_words" if words else name)
                                  for name, words in kcfg.versioned().items()}
        self.ce = constexprs(self.spec, kcfg, self.program.max_splits)
        # [num_sms, max_len, TRACE_STAMPS] int64 ns timestamps per instruction when kcfg.trace (trace.summarize), else
        # a 1-element dummy
        self.trace = torch.zeros((self.num_sms, self.words.shape[1], TRACE_STAMPS.value) if kcfg.trace else (1,),
                                 dtype=torch.int64, device=dev)
        # [num_sms, max tiles per SM, 4] int64 ns per weight tile when kcfg.trace_tiles (trace.summarize_tiles)
        self.max_tiles = 1
        if kcfg.trace_tiles:
            self.max_tiles = max(1, *map(sum, tile_counts(self.program, kcfg.tile_rows, kcfg.tile_k)))
        self.tiles = torch.zeros((self.num_sms, self.max_tiles, 4) if kcfg.trace_tiles else (1,), dtype=torch.int64,
                                 device=dev)

    def _set_up_clusters(self) -> str | None:
        """Compile the cluster-pair kernel (the JIT's cached kernel of this specialization, which every later launch
        finds) and set it to launch in clusters of two CTAs with the exchange region past Triton's shared memory.
        Returns None, or why it cannot run here: fewer clusters of two fit the GPU at once than it needs resident."""
        from . import cluster

        compiled = self._compile_for_launch(2)
        grid = (self.num_sms // 2,)
        compiled._init_handles()  # load it: the occupancy query needs the CUfunction
        num_warps, _, smem = compiled.packed_metadata
        fit = cluster.max_active_clusters(compiled.function, 2, 32 * num_warps, smem)
        if fit < grid[0]:
            return (f"cluster_qkv: {fit} clusters of two fit this GPU at {smem} bytes of shared memory, the kernel "
                    f"needs {grid[0]} resident ({self.num_sms} SMs)")
        return None

    def _compile_for_launch(self, cluster_size: int):
        """Compile this specialization (the JIT's cached kernel, which every later launch finds) and set it to launch
        in clusters of ``cluster_size`` CTAs with the dynamic shared memory past Triton's that it needs
        (``KernelConfig.region_bytes``: the release hold's count, the per-warp releases' barriers, the cluster
        exchange)."""
        from . import cluster
        from .kernel import megakernel

        grid = (self.num_sms // cluster_size,)
        return cluster.in_clusters(megakernel.warmup(*self._args(), grid=grid, **self.ce), cluster_size,
                                   self.kcfg.region_bytes(self.spec))

    def _args(self) -> tuple:
        s, x, w, c = self.state, self.scratch, self.w, self.cache
        sp = self.spec
        buf = self.versioned_buffers
        return (
            self.words, self.lens, self.words.shape[1], s.tokens, s.positions, s.seg_ctx, s.block_tables,
            s.block_tables.shape[1], s.counters, len(self.program.counters), self.ready_words, *self.descs,
            w.embed, w.attn_norm, w.mlp_norm, w.final_norm, w.bias, w.q_norm, w.k_norm, w.inv_freq,
            c.k, c.v, c.layout.num_pages, buf["x"], x.qkv_part, buf["q"], x.part_o, x.part_ml, buf["attn"], buf["act"],
            x.logits, x.x_part, self.program.max_splits, sp.rms_norm_eps, sp.head_dim ** -0.5 * 1.4426950408889634,
            self.trace, self.tiles, self.max_tiles)

    def set_inputs(self, token: int, position: int, block_table: Sequence[int]) -> None:
        self.state.fill([token], [position], [block_table], [1])
        self.inputs_set = True

    def launch(self) -> None:
        """One decode step with the current step state. The state must hold a real step: a launch on an empty state
        would append K/V for position 0 through page 0 of the (zeroed) block table, overwriting a live page."""
        from .kernel import megakernel

        if not self.inputs_set:
            raise RuntimeError("set_inputs() must be called before the first launch")
        # cluster pairs (KernelConfig.cluster_qkv): the kernel __init__ set to launch in clusters of two CTAs
        megakernel[(self.num_sms // 2 if self.ce["XB"] else self.num_sms,)](*self._args(), **self.ce)

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
