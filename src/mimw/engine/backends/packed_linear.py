"""PackedLinear: the CPU's few-row matmuls on weights prepacked once for oneDNN, so a verify block costs less.

A speculative verify step runs every linear layer on 1 + k rows (k drafted tokens). On the CPU, ``F.linear``
streams the weights through a GEMV for one row, which runs at the memory's speed, but for 2-64 rows takes MKL's
general GEMM, which repacks the weight on every call: a 5-row step costs ~2x a 1-row one there (SmolLM2-135M in
fp32, one thread), and that slope decides how far speculation pays (``engine/spec/policy.py``). oneDNN's linear on
a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what
``torch.compile``'s CPU backend uses for linear layers) reads the weight as it is stored: 5 rows cost ~1.2x one.

``PackedLinear(weights)`` is a drop-in ``linear(x, w, b)`` for ``ReferenceDecoder``: ``rows`` in [min_rows,
max_rows] (default 4-64) take the packed weight; everything else (a one-row decode step, 2-3 rows, which MKL still
runs at GEMV speed, a prefill chunk, a weight it did not pack) is ``F.linear`` exactly as before, so plain
decoding's numbers do not change. The packed weights take as much memory
again as the dense ones they shadow. ``available()`` says whether this torch build has the ops (x86 builds with
oneDNN); elsewhere the backend does not build one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models.weights import ModelWeights


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear:
    def __init__(self, weights: ModelWeights, min_rows: int = 4, max_rows: int = 64):
        if weights.device.type != "cpu":
            raise ValueError(f"PackedLinear packs CPU weights, got weights on {weights.device}")
        if not available():
            raise RuntimeError("this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
        if not 2 <= min_rows <= max_rows:
            raise ValueError(f"need 2 <= min_rows <= max_rows, got {min_rows}, {max_rows}")
        self.min_rows, self.max_rows = min_rows, max_rows
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # data_ptr -> (weight, packed weight)
        dense = [weights.lm_head]
        for lw in weights.layers:
            dense += [lw.wq, lw.wk, lw.wv, lw.wo, getattr(lw, "w_gate", None), getattr(lw, "w_up", None),
                      getattr(lw, "w_down", None)]
        for w in dense:
            if w is not None and w.dim() == 2 and w.dtype == torch.float32 and w.data_ptr() not in self._packed:
                self._packed[w.data_ptr()] = (w, torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8))

    @property
    def num_packed(self) -> int:
        return len(self._packed)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        few = self.min_rows <= rows <= self.max_rows and x.dtype == torch.float32
        hit = self._packed.get(w.data_ptr()) if few else None
        if hit is None or hit[0] is not w:  # the same storage, not just the same address
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), hit[1], b, "none", [], "")
