"""The megakernel backend: decode tokens run on the persistent Gluon megakernel (Hopper, bf16), multi-token
segments (prefill chunks, verify blocks) on the prefill path (``mimw.prefill``) over the SAME bf16 paged cache (the
only KV element type it accepts for now).

The megakernel program is planned for M = 1: a step of one decode token is one megakernel launch (one CUDA graph
replay). A step of several decode tokens runs either as one launch per sequence or as one pass of the
``PrefillRunner``'s layers, whichever this backend measured faster for that batch size on this GPU (``StepRouter``);
every other step (prefill chunks, verify blocks, mixes) is one pass of the runner. The runner writes the segments'
K/V into the shared cache exactly as the kernel reads it, so decode continues from those pages with no copy. (The
megakernel's own decode-batch step, ``MegakernelDecoder.step_batch``, is not one of these paths: it has not run on a
GPU yet.) The weights are fused (q/k/v, gate/up) once here for the prefill path's GEMMs, and the megakernel packs its own
tile-major copy from row views of them (launch/pack.py): the GPU holds the weights twice, row-major and tile-major.
Invariants are those of ``Backend``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.reference import Segment
from ...models.weights import ModelWeights
from ...prefill import FusedWeights, PrefillConfig, PrefillRunner
from .base import Backend, EventTimer
from .step_router import REPLAY, StepRouter


class MegakernelBackend(Backend):
    def __init__(self, weights: ModelWeights, use_graph: bool = True, prefill: PrefillConfig = PrefillConfig(),
                 kv_dtype: torch.dtype | None = None):
        if kv_dtype not in (None, torch.bfloat16):  # checked first: a flag error, whatever the machine
            raise ValueError(f"KV element type {str(kv_dtype).removeprefix('torch.')}: the megakernel backend does "
                             "not read FP8 KV pages yet (its attention loads bf16 tiles); use --kv-dtype bf16, or "
                             "--backend reference for an fp8 KV cache")
        if weights.spec.is_moe:  # megakernel/plan.py refuses the program too; say it before any GPU work
            raise ValueError(f"the megakernel backend does not run mixture-of-experts models ({weights.spec.name}) "
                               "yet; use the reference backend")
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            raise RuntimeError("the megakernel backend needs a Hopper (sm_90) GPU; use the reference backend")
        fused = FusedWeights.from_weights(weights.to(device="cuda", dtype=torch.bfloat16))
        self.weights = fused.unfused()
        self.spec = weights.spec
        self.prefill = PrefillRunner(fused, prefill)
        self.use_graph = use_graph
        self._dec = None  # built on the first decode, for the cache the engine made
        self.router = StepRouter()
        self._timer = EventTimer()  # decode steps' times by (path, batch), for the router

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def _decoder(self, cache: PagedKVCache):
        from ...megakernel.launch.decoder import MegakernelDecoder

        if self._dec is None or self._dec.cache is not cache:
            # the decoder captures its CUDA graph on its first step, once the state holds that real step
            self._dec = MegakernelDecoder(self.weights, cache, use_graph=self.use_graph)
        return self._dec

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        for (path, batch), ms in self._timer.completed():
            self.router.observe(path, batch, ms)
        if not all(s.length == 1 and s.num_logits == 1 for s in segments):
            return self.prefill.forward(tokens, segments, cache)
        path = self.router.choose(len(segments))
        start = self._timer.start()
        step = self.decode_replays if path == REPLAY else self.decode_pass
        out = step(tokens, segments, cache)
        self._timer.stop(start, (path, len(segments)))
        return out

    def decode_replays(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """Single-token segments as one megakernel launch each."""
        dec = self._decoder(cache)
        ids = tokens.tolist()
        # each step returns the decoder's logits buffer, which the next step overwrites: copy each row out
        return torch.cat([dec.step(ids[i], s.start, s.block_table)[:1].to(torch.float32, copy=True)
                          for i, s in enumerate(segments)])

    def decode_pass(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """Any segments as one pass of the prefill path."""
        return self.prefill.forward(tokens, segments, cache)
