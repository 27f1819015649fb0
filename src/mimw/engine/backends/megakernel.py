"""The megakernel backend: decode tokens run on the persistent Gluon megakernel (Hopper, bf16), multi-token
segments (prefill chunks, verify blocks) on the prefill path (``mimw.prefill``) over the SAME bf16 paged cache (the
only KV element type it accepts for now).

The megakernel program is planned for M = 1: a step of exactly one decode token is one megakernel launch (one
CUDA graph replay). Every other step (several decoding sequences, prefill chunks, verify blocks, or a mix) goes to
the ``PrefillRunner`` in one call, so its weights are read once per step, not once per sequence; it writes the
segments' K/V into the shared cache exactly as the kernel reads it, so decode continues from those pages with no
copy. (The megakernel's own multi-token step, issue 25, replaces this path for decode batches and verify blocks.)
The weights are fused (q/k/v, gate/up) once here for the prefill path's
GEMMs, and the megakernel packs its own tile-major copy from row views of them (launch/pack.py): the GPU holds the
weights twice, row-major and tile-major. Invariants are those of ``Backend``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...kv.pages import PagedKVCache
from ...models.reference import Segment
from ...models.weights import ModelWeights
from ...prefill import FusedWeights, PrefillConfig, PrefillRunner
from .base import Backend


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
        if len(segments) == 1 and segments[0].length == 1 and segments[0].num_logits == 1:
            s = segments[0]
            return self._decoder(cache).step(int(tokens[0]), s.start, s.block_table)[:1].float().clone()
        return self.prefill.forward(tokens, segments, cache)
