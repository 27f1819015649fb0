"""The prefill path: multi-token steps over the paged KV cache (fused GEMMs, Triton kernels, paged attention).

``PrefillRunner`` runs them; ``PrefillConfig`` picks the attention (mimw's warp-specialized Gluon kernel for Hopper,
the serving one; its paged Triton sibling; torch SDPA, cuDNN or FlexAttention over gathered pages; or the
reference's) and the elementwise kernels (Triton or the reference's).
"""
from .paged_attention import AttentionTiles
from .runner import PrefillConfig, PrefillRunner
from .weights import FusedWeights

__all__ = ["AttentionTiles", "FusedWeights", "PrefillConfig", "PrefillRunner"]
