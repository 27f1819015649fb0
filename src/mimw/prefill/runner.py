"""PrefillRunner: multi-token steps (prefill chunks, verify blocks) over the paged KV cache, on the GPU kernels of
this package or, for the CPU and the tests, on the reference decoder's functions.

One call = the step's segments; it is cut into passes of at most ``max_pass_tokens`` tokens (``split_passes``:
activations stay bounded however long the step) and each pass runs the layers over all its pieces at once:

    x = embed[tokens]
    per layer:  h = rms_norm(x)                       ops.rms_norm
                qkv = h @ wqkv^T (+ bqkv)             one fused bf16 GEMM
                q = rope_append(qkv)                  q/k head norm, RoPE, K/V written into the cache pages
                o = attention(q, cache pages)         causal over everything the sequence holds (paged)
                x = x + o @ wo^T                      addmm: the residual add inside the GEMM
                h = rms_norm(x)
                x = x + silu_mul(h @ w_gate_up^T) @ w_down^T
    logits of each piece's last num_logits rows: rms_norm, lm_head, fp32

The cache is read and written in the ``mimw.kv.pages`` layout the megakernel reads, so decode continues on the
megakernel from the same pages with no copy. Over an fp8 cache ``rope_append`` quantises each K/V row with its own
bf16 scale (``mimw.kv.fp8.quantize``'s bits) and every attention dequantises rows with their scales. Invariants are
``Backend.forward``'s: a pass writes only its own positions and reads earlier ones from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..kv.pages import PagedKVCache
from ..models import rope
from ..models.reference import Segment
from ..models.weights import ModelWeights
from . import activation, norm, rope_append
from .batch import Piece, PrefillBatch, split_passes
from .flex_attention import FlexPagedAttention
from .gathered_attention import (GatheredAttention, LibraryAttention, cudnn_attention, sdpa_attention,
                                 torch_attention)
from .gluon_attention import GluonAttention, GluonTiles
from .paged_attention import AttentionTiles, PagedAttention
from .weights import FusedWeights

ATTENTIONS = ("triton", "gluon", "cudnn", "sdpa", "flex", "torch")
KERNELS = ("triton", "torch")


@dataclass(frozen=True)
class PrefillConfig:
    """attention: "gluon" (the serving path's: the warp-specialized, TMA-fed paged kernel for Hopper,
    ``gluon_attention``, which runs short passes and fp8 caches on the Triton kernel; measured against it in
    bench/NOTES.md, "p3"), "triton" (mimw's paged Triton kernel alone), "cudnn" / "sdpa" / "flex" (torch's over
    gathered pages, ``gathered_attention`` and ``flex_attention``: what ``mimw bench prefill`` measures the paged
    kernels against) or "torch" (the reference's fp32 attention); kernels: "triton" (norm, RoPE + append, SwiGLU)
    or "torch" (the reference's functions); tiles: the paged Triton kernel's ``AttentionTiles`` or the Gluon
    kernel's ``GluonTiles`` (None: their ``for_head_dim``)."""

    attention: str = "gluon"
    kernels: str = "triton"
    max_pass_tokens: int = 16384
    tiles: AttentionTiles | GluonTiles | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.max_pass_tokens <= 0:
            raise ValueError(f"max_pass_tokens must be positive, got {self.max_pass_tokens}")
        if self.tiles is not None and self.attention in ("triton", "gluon"):
            want = AttentionTiles if self.attention == "triton" else GluonTiles
            if not isinstance(self.tiles, want):
                raise ValueError(f"attention {self.attention!r} takes {want.__name__}, got {self.tiles!r}")

    @classmethod
    def reference(cls, max_pass_tokens: int = 16384) -> "PrefillConfig":
        """The reference decoder's functions throughout (any device)."""
        return cls("torch", "torch", max_pass_tokens)


@dataclass(frozen=True)
class PrefillOps:
    rms_norm: Callable
    rope_append: Callable
    silu_mul: Callable


OPS = {"triton": PrefillOps(norm.rms_norm, rope_append.rope_append, activation.silu_mul),
       "torch": PrefillOps(norm.rms_norm_torch, rope_append.rope_append_torch, activation.silu_mul_torch)}


def make_attention(name: str, tiles: AttentionTiles | GluonTiles | None, device: torch.device):
    if name == "triton":
        return PagedAttention(tiles)
    if name == "flex":
        return FlexPagedAttention(compile=device.type == "cuda")
    if name in ("cudnn", "gluon") and device.type != "cuda":  # cuDNN's fused kernel, the Hopper kernel
        raise ValueError(f"attention {name!r} runs on CUDA only (weights on {device})")
    if name == "cudnn":
        return LibraryAttention(cudnn_attention)
    if name == "gluon":
        if torch.cuda.get_device_capability(device) != (9, 0):  # TMA and wgmma as sm_90a has them
            raise ValueError(f"attention 'gluon' runs on a Hopper (sm_90) GPU, not "
                             f"{torch.cuda.get_device_name(device)}; use attention 'triton'")
        return GluonAttention(tiles)
    return GatheredAttention(sdpa_attention if name == "sdpa" else torch_attention)


class PrefillRunner:
    def __init__(self, weights: FusedWeights | ModelWeights, config: PrefillConfig = PrefillConfig()):
        self.w = weights if isinstance(weights, FusedWeights) else FusedWeights.from_weights(weights)
        self.spec = self.w.spec
        self.config = config
        self.ops = OPS[config.kernels]
        self.attention = make_attention(config.attention, config.tiles, self.w.device)
        self._inv_freq = rope.inv_freq(self.spec).to(self.w.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], cache: PagedKVCache) -> torch.Tensor:
        """tokens [T] (the segments' tokens concatenated) -> fp32 logits [sum(num_logits), vocab], in segment
        order; writes every token's K/V into ``cache``."""
        if sum(s.length for s in segments) != tokens.numel():
            raise ValueError("segments' lengths must add up to the number of tokens")
        tokens = tokens.to(self.w.device)
        pieces = [Piece(tuple(s.block_table), s.start, s.length, s.num_logits) for s in segments]
        outs, t0 = [], 0
        for ps in split_passes(pieces, self.config.max_pass_tokens):
            n = sum(p.length for p in ps)
            batch = PrefillBatch.build(ps, cache.layout.page_size, self.w.device)
            outs.append(self._pass(tokens[t0:t0 + n], batch, cache))
            t0 += n
        return torch.cat(outs)

    def _pass(self, tokens: torch.Tensor, batch: PrefillBatch, cache: PagedKVCache) -> torch.Tensor:
        spec, w, ops = self.spec, self.w, self.ops
        eps, t = spec.rms_norm_eps, tokens.numel()
        # [T, hd/2] fp32, shared by every layer: rope.cos_sin's arithmetic from inverse frequencies kept on the
        # device (no host-to-device copy inside a pass, so a pass can be captured in a CUDA graph)
        ang = batch.positions.float()[:, None] * self._inv_freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        attend = self.attention.plan(batch)
        x = F.embedding(tokens, w.embed)
        quantized = cache.layout.quantized
        for li, lw in enumerate(w.layers):
            k_layer, v_layer = cache.k[li], cache.v[li]
            # fp8: each row's bf16 scale, [P, Hkv, PS] beside the layer's pages (mimw.kv.pages)
            ks, vs = (cache.k_scale[li], cache.v_scale[li]) if quantized else (None, None)
            h = ops.rms_norm(x, lw.attn_norm, eps)
            qkv = F.linear(h, lw.wqkv, lw.bqkv)
            q = ops.rope_append(qkv, cos, sin, k_layer, v_layer, batch.slots, spec.num_heads, lw.q_norm,
                                lw.k_norm, eps, ks, vs)
            o = attend(q, k_layer, v_layer, ks, vs)
            x = torch.addmm(x, o.reshape(t, -1), lw.wo.t())
            h = ops.rms_norm(x, lw.mlp_norm, eps)
            x = torch.addmm(x, ops.silu_mul(F.linear(h, lw.w_gate_up)), lw.w_down.t())
        x = ops.rms_norm(x[batch.logit_rows], w.final_norm, eps)
        return F.linear(x, w.lm_head).float()
