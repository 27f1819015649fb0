"""The reference backend: ``mimw.models.reference.ReferenceDecoder`` behind the ``Backend`` interface.

The oracle returns logits for every token; a step only needs the last token of each segment, and the LM head over
a whole prefill chunk costs T x vocab x hidden (for a 49k vocabulary, about as much as all layers of a small model).
So the oracle runs with an identity "LM head" - it then returns the final-normed hidden states [T, D] exactly
(x @ I adds only zeros) - and the real LM head is applied to the segments' last rows here.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F

from ...kv.pages import PagedKVCache
from ...models.reference import ReferenceDecoder, Segment
from ...models.weights import ModelWeights
from .base import Backend


class ReferenceBackend(Backend):
    def __init__(self, weights: ModelWeights):
        self.weights = weights
        self.spec = weights.spec
        eye = torch.eye(self.spec.hidden_size, dtype=weights.dtype, device=weights.device)
        self._hidden = ReferenceDecoder(dataclasses.replace(weights, lm_head=eye))

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.weights.dtype

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        h = self._hidden.forward(tokens, segments, cache)  # [T, D] fp32 (exact copy of the normed hidden state)
        last = torch.tensor([s.length for s in segments], device=h.device).cumsum(0) - 1
        return F.linear(h[last].to(self.weights.dtype), self.weights.lm_head).float()  # [S, V]
