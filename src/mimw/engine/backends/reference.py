"""The reference backend: ``mimw.models.reference.ReferenceDecoder`` behind the ``Backend`` interface.

The KV pool holds ``kv_dtype`` (default: the weights' dtype, so fp32 on the CPU); any element type of
``mimw.kv.pages`` works on any device, fp8 included: the decoder attends to what the cache holds, dequantised.

A step only needs the last token of each segment (the last ``num_logits`` of a verify block), and the LM head over a whole prefill chunk costs
T x vocab x hidden (for a 49k vocabulary, about as much as all layers of a small model), so the oracle runs with
``last_only=True``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ...kv.pages import KV_DTYPES, PagedKVCache
from ...models.reference import ReferenceDecoder, Segment
from ...models.weights import ModelWeights
from .base import Backend
from .packed_linear import PackedLinear, available


class ReferenceBackend(Backend):
    def __init__(self, weights: ModelWeights, kv_dtype: torch.dtype | None = None, packed_linear: bool = False):
        """``packed_linear``: run the few-row steps (speculative verify blocks) of fp32 CPU weights on oneDNN-
        prepacked copies (``packed_linear.PackedLinear``); ignored where that does not apply (a GPU, other dtypes,
        a torch without oneDNN). One-row decode steps and prefill chunks of more than 64 tokens are unchanged."""
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ValueError(f"the reference backend stores KV as one of {KV_DTYPES}, not {kv_dtype}")
        self.weights = weights
        self.spec = weights.spec
        self._kv_dtype = kv_dtype or weights.dtype
        self.packed = None
        if packed_linear and weights.device.type == "cpu" and weights.dtype == torch.float32 and available():
            self.packed = PackedLinear(weights)
        self._decoder = ReferenceDecoder(weights, self.packed or F.linear)

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self._kv_dtype

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        return self._decoder.forward(tokens, segments, cache, last_only=True)  # [sum(num_logits), V] fp32
