"""The megakernel backend: decode tokens and short multi-token steps run on the persistent Gluon megakernel
(Hopper, bf16), prefill chunks on the prefill path (``mimw.prefill``) over the SAME paged cache: bf16, or fp8 e4m3
with a bf16 scale per (token, KV head) row (``kv_dtype``, ``mimw.kv.fp8``), which the prefill path's K/V append
quantises exactly as the kernel's own row store does (``fp8.quantize``) and every reader dequantises row by row.

A step of one decode token is one megakernel launch (one CUDA graph replay). A step of several decode tokens runs as
one launch per sequence, as one launch of the megakernel's multi-token step (2..plan.max_tokens tokens:
``MegakernelDecoder.step_segments``), or as one pass of the ``PrefillRunner``'s layers, whichever this backend
measured fastest for that token count on this GPU (``StepRouter``). A step of verify blocks (every token's logits
wanted) of 2..max_tokens tokens in all runs on the multi-token step or one pass, measured the same way (no replays:
they are one token's); a step with a prefill chunk, and a longer step, is one pass of the runner (the multi-token
step plans each layout of query blocks anew, ~0.2 s of host work: worth it for a verify layout that repeats, not for
the chunk lengths of prefill, which rarely do). ``prepare`` compiles every kernel the steps can launch before
serving (a compile inside a step, seconds, would stall every stream). A pass whose segments are short (each fits one
query block of the paged attention kernel: decode batches, verify blocks) replays as a CUDA graph per step pattern
(``StepGraphs``); long prefill chunks run eager. The runner writes the segments' K/V into the shared cache exactly
as the kernel reads it, so decode continues from those pages with no copy. The weights are fused (q/k/v, gate/up)
once here for the prefill path's GEMMs, and the megakernel packs its own tile-major copy from row views of them
(launch/pack.py): the GPU holds the weights twice, row-major and tile-major. A mixture-of-experts model's decode
steps run on the megakernel as one-token launches or, where its multi-token step plans (plan.max_tokens: up to
plan.MAX_MOE_BATCH tokens; 1 where its heads take 16-row tiles), as that step, which reads each distinct routed
expert once; its prefill chunks and verify blocks run eager on the bf16 reference decoder (``ReferencePrefill``: the
prefill path has no MoE block yet, and the MoE step's query blocks are not GPU-checked).
Invariants are those of ``Backend``.
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import Sequence

import torch

from ...kv import fp8
from ...kv.pages import PagedKVCache
from ...models.reference import ReferenceDecoder, Segment
from ...models.weights import ModelWeights
from ...pinned import to_device
from ...prefill import FusedWeights, PrefillConfig, PrefillRunner
from ..step_costs import bucket
from .base import Backend, EventTimer
from .step_graphs import StepGraphs
from .step_router import BATCHED, KERNEL, REPLAY, StepRouter, step_paths

PREFILL = "prefill"  # ``steps_by_path``'s key for a step the router does not take (a prompt chunk: one pass)


def logit_rows(out: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Rows ``rows`` of the decoder's logits buffer ``out`` [N, V] (fp32), copied out (the next launch overwrites
    the buffer) without waiting for the GPU: a leading run (a decode batch, padded or not) as a slice, any other
    rows (verify blocks' logit rows) by an index that goes to the device through pinned memory. Indexing a CUDA
    tensor with a Python list would copy that list from pageable memory, which waits for the stream."""
    n = len(rows)
    if tuple(rows) == tuple(range(n)):
        return out[:n].to(torch.float32, copy=True)
    return out.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), out.device))


class ReferencePrefill:
    """A mixture-of-experts model's prefill path: the reference decoder (bf16, transformers' numerics) over the
    backend's cache, every segment's last ``num_logits`` rows, fp32 (``PrefillRunner.forward``'s contract)."""

    def __init__(self, weights: ModelWeights):
        self.decoder = ReferenceDecoder(weights)

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        return self.decoder.forward(tokens, segments, cache, last_only=True).float()


class MegakernelBackend(Backend):
    def __init__(self, weights: ModelWeights, use_graph: bool = True, prefill: PrefillConfig = PrefillConfig(),
                 kv_dtype: torch.dtype | None = None):
        kv_dtype = kv_dtype or torch.bfloat16
        if kv_dtype not in (torch.bfloat16, fp8.FP8):  # checked first: a flag error, whatever the machine
            raise ValueError(f"KV element type {str(kv_dtype).removeprefix('torch.')}: the megakernel backend keeps "
                             "its KV cache in bf16 or fp8 (--kv-dtype bf16 or fp8)")
        if weights.spec.is_moe:  # a plan for its one-token step over this cache must exist (ValueError naming why,
            # before any GPU: an MoE model over an fp8 cache is refused there)
            from ...megakernel.plan import plan

            plan(weights.spec, 132, kv_dtype=kv_dtype)
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            raise RuntimeError("the megakernel backend needs a Hopper (sm_90) GPU; use the reference backend")
        self.spec = weights.spec
        self._kv_dtype = kv_dtype
        if weights.spec.is_moe:  # the prefill path (prefill/) has no MoE block: MoE prefill runs on the bf16
            # reference decoder over the same cache
            self.weights = weights.to(device="cuda", dtype=torch.bfloat16)
            self.prefill = ReferencePrefill(self.weights)
        else:
            fused = FusedWeights.from_weights(weights.to(device="cuda", dtype=torch.bfloat16))
            self.weights = fused.unfused()
            self.prefill = PrefillRunner(fused, prefill)
        self.use_graph = use_graph
        self._dec = None  # built on the first decode, for the cache the engine made
        self._graphs = None  # short steps' graphs over the prefill path, for the cache the engine made
        self.router = StepRouter()
        from ...megakernel.plan import max_tokens

        # the most tokens the megakernel's multi-token step runs for this model (plan.max_tokens: 32, the 8B's 16, an
        # MoE model's plan.MAX_MOE_BATCH where its step plans, else 1)
        self.max_tokens = max_tokens(weights.spec)
        # an MoE model's pass is the eager reference decoder (module doc): never a decode path, and its verify blocks
        # stay off the multi-token step
        self._moe = weights.spec.is_moe
        self._timer = EventTimer()  # decode steps' times by (path, batch), for the router
        # steps run so far by path: the router's choices, and PREFILL for steps with a prompt chunk (one pass)
        self.steps_by_path: Counter[str] = Counter()
        # cache -> the page past the caller's that padding rows write (weak: a cache's entry dies with it)
        self._pad_pages: weakref.WeakKeyDictionary[PagedKVCache, int] = weakref.WeakKeyDictionary()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")

    @property
    def kv_dtype(self) -> torch.dtype:
        return self._kv_dtype

    def make_cache(self, page_size: int, num_pages: int) -> PagedKVCache:
        """``num_pages`` pages for the caller, and one more past them that no sequence owns: the multi-token step
        pads M tokens to their bucket with rows on it (megakernel/launch/one_token.py). The decoder and the step
        graphs of an earlier cache are dropped first: they hold that cache, whose pool could not be freed while a
        new one is allocated (an engine replacing another on this backend); a later step over the old cache builds
        them again."""
        self._dec = self._graphs = None
        cache = super().make_cache(page_size, num_pages + 1)
        self._pad_pages[cache] = num_pages
        return cache

    def prepare(self, cache: PagedKVCache, max_batch: int = 1) -> None:
        """Compile the kernel of every step shape ``forward`` can launch over ``cache``: the one-token step, and for
        each bucket of tokens (powers of two up to ``max_tokens``) its decode batch (which short verify blocks run
        on too: ``plan.min_query_block``) and (not for an MoE model: its verify blocks run eager) its query-block
        kernel where a query block fits the bucket, which serves every layout of longer verify blocks in the bucket
        (plan.plan). The JIT keeps them (and Triton's cache on disk: a later process loads them); the query-block
        decoder compiled here is dropped, a verify step plans its own layout. First start ~10 s a kernel.

        Then, where ``cache`` is this backend's, the CUDA graph of every decode path is captured for each bucket up
        to ``max_batch`` (the engine's most sequences a step), as vLLM and SGLang capture theirs at start: the M = 1
        step's, each bucket's multi-token step (a decode batch pads to its bucket with one-token rows: one layout a
        bucket) and graphed pass (``StepGraphs`` pads alike; a pass pattern runs eager at its first sighting and is
        captured at its second). The steps run on the pad page (rows at position 0 of the page no sequence owns), so
        they write no sequence's K/V, and the router's estimates are not fed (such a step reads no past K/V)."""
        from ...megakernel.launch.one_token import query_blocks
        from ...megakernel.plan import min_query_block

        dec = self._decoder(cache)
        dec.compile()
        m = 2
        while m <= self.max_tokens:
            dec.batch_decoder(m).compile()
            if not self._moe:
                # any layout with a query block: the bucket's block kernel (none where no block fits the bucket)
                blocks = query_blocks((m,), least=min_query_block(cache.layout.dtype))
                if blocks:
                    dec.batch_decoder(m, blocks).compile()
                    dec.forget(m, blocks)
            m *= 2
        pad = self._pad_pages.get(cache)
        if pad is None:
            return
        self.decode_replays(torch.zeros(1, dtype=torch.long, device=self.device), [Segment((pad,), 0, 1, 1)], cache)
        m = 2
        while m <= bucket(max_batch):
            if m <= self.max_tokens:
                dec.warm_bucket(m, pad)
            if not self._moe:
                ids = torch.zeros(m, dtype=torch.long, device=self.device)
                for _ in range(2):
                    self.decode_pass(ids, [Segment((pad,), 0, 1, 1)] * m, cache)
            m *= 2
        torch.cuda.synchronize()

    def _decoder(self, cache: PagedKVCache):
        from ...megakernel.launch.decoder import MegakernelDecoder

        if self._dec is None or self._dec.cache is not cache:
            # the decoder captures its CUDA graph on its first step, once the state holds that real step
            self._dec = MegakernelDecoder(self.weights, cache, use_graph=self.use_graph)
        return self._dec

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        for (path, batch), ms in self._timer.completed():
            self.router.observe(path, batch, ms)
        m = int(tokens.numel())
        whole = step_paths(segments, self.max_tokens, self._moe)
        if whole is None:  # prefill chunks, long verify steps, an MoE model's verify blocks: the prefill path
            self.steps_by_path[PREFILL] += 1
            return self.decode_pass(tokens, segments, cache)
        # a step the router takes is decode tokens or verify blocks (every token's logits wanted): a decode step
        # exactly when every segment is one token
        path = self.router.choose(m, whole, replays=m == len(segments))
        self.steps_by_path[path] += 1
        unmeasured = self._graphs.patterns.unmeasured if self._graphs is not None else 0
        start = self._timer.start()
        step = {REPLAY: self.decode_replays, KERNEL: self.decode_kernel, BATCHED: self.decode_pass}[path]
        out = step(tokens, segments, cache)
        # a step that captured a graph or ran a pattern's first sighting eager is no measure of its path
        if self._graphs is None or self._graphs.patterns.unmeasured == unmeasured:
            self._timer.stop(start, (path, m))
        return out

    def decode_replays(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """Single-token segments as one megakernel launch each. The ids stay on the device (the previous step's
        samples may not have reached the host) and the step state goes by non-blocking copies from pinned memory
        (``StepState.fill``), so queueing the launches never waits for the GPU."""
        dec = self._decoder(cache)
        # each step returns the decoder's logits buffer, which the next step overwrites: copy each row out (one
        # segment, the batch-1 step: its row is the result, no concatenation's second copy)
        rows = [dec.step_batch(tokens[i:i + 1], [s.start], [s.block_table])[:1].to(torch.float32, copy=True)
                for i, s in enumerate(segments)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def decode_kernel(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """Segments of 2..plan.max_tokens tokens in all (decode tokens, verify blocks; any short segments when
        called directly) as one launch of the megakernel's multi-token step (one-token segments:
        megakernel/launch/one_token.py; a verify block's attention as one query block), padded to the bucket of its
        tokens where the cache is this backend's (one kernel a bucket, not a token count; one graph a bucket for decode
        batches, one a layout of verify blocks)."""
        pad_page = self._pad_pages.get(cache)  # a cache this backend made: padded to the bucket of its tokens
        # the ids stay on the device (the previous step's samples may not have reached the host)
        out, rows = self._decoder(cache).step_segments(tokens, segments, pad_page)
        return logit_rows(out, rows)

    def decode_pass(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """Any segments as one pass of the prefill path: replayed as a CUDA graph when every segment fits one query
        block of the paged attention kernel (decode batches, verify blocks: ``StepGraphs``), else eager (an MoE
        model's reference prefill always)."""
        if isinstance(self.prefill, ReferencePrefill):
            return self.prefill.forward(tokens, segments, cache)
        if self._graphs is None or self._graphs.cache is not cache:
            # decode batches pad to buckets on the page past the caller's (make_cache), where the cache is ours
            self._graphs = StepGraphs(self.prefill, cache, pad_page=self._pad_pages.get(cache))
        if self._graphs.fits(segments):
            return self._graphs.forward(tokens, segments)
        return self.prefill.forward(tokens, segments, cache)

