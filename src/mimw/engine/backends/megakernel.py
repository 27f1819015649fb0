"""The megakernel backend: decode tokens run on the persistent Gluon megakernel (Hopper, bf16), multi-token
segments (prefill chunks, verify blocks) on the prefill path (``mimw.prefill``) over the SAME bf16 paged cache (the
only KV element type it accepts for now).

The megakernel program is planned for M = 1 (one decode token per launch, one CUDA graph replay); a step with
several decoding sequences replays it once per sequence. All multi-token segments of a step go to the
``PrefillRunner`` in one call; it writes their K/V into the shared cache exactly as the kernel reads it, so decode
continues from those pages with no copy. The weights are fused (q/k/v, gate/up) once here for the prefill path's
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
        out = torch.empty(sum(s.num_logits for s in segments), self.spec.vocab_size, device="cuda",
                          dtype=torch.float32)
        t0, r0, pre, pre_rows, pre_toks = 0, 0, [], [], []
        for s in segments:
            if s.length == 1:
                out[r0] = self._decoder(cache).step(int(tokens[t0]), s.start, s.block_table)[0]
            else:
                pre.append(s)
                pre_rows.extend(range(r0, r0 + s.num_logits))
                pre_toks.append(tokens[t0:t0 + s.length])
            t0 += s.length
            r0 += s.num_logits
        if pre:
            out[pre_rows] = self.prefill.forward(torch.cat(pre_toks), pre, cache)
        return out
