"""DecodeInputs: the one decode step every backend runs, with its KV cache pre-filled to the context.

A decode step at context C feeds one token at position C and attends to positions 0..C. Prefilling C real tokens
through every backend would cost more GPU time than the measurements, and the step's cost does not depend on the
values in the cache, so the first C positions are filled with seeded random K/V (~N(0, 1), the scale of real
post-RoPE keys relative to random-weight queries: attention scores ~N(0, 1), softmax neither flat nor one-hot).
Every backend copies the same ``k``/``v`` into its own cache layout, so all of them compute the same logits.

Contract for mimw backends built outside this package (``mimw.megakernel.bench_backend.make_step``): fill your KV
positions 0..C-1 from ``decode_inputs(spec, C, device=...)`` (same ``seed``), decode ``token`` at position ``C``.

With ``kv_dtype`` fp8 (``mimw bench decode --kv-dtype fp8``) the random K/V are passed through the fp8 format
(``mimw.kv.fp8``) and kept as the exact dequantised values in fp32: ``paged_cache`` quantises them back to the very same
e4m3 rows and scales (re-quantising dequantised values changes nothing), the fp32 oracle reads them exactly, and a
peer without an fp8 path loads them into its bf16 cache (rounded to bf16: 2^-9 relative, far inside the check's
tolerance).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kv import fp8
from ..kv.pages import KVLayout, PagedKVCache
from ..models.reference import ReferenceDecoder, Segment
from ..models.spec import ModelSpec
from ..models.weights import ModelWeights


@dataclass
class DecodeInputs:
    token: int                # the token decoded at position ``context``
    context: int              # C: positions 0..C-1 are in the cache
    k: torch.Tensor           # [L, C, Hkv, hd] keys (RoPE already applied, as a cache stores them)
    v: torch.Tensor           # [L, C, Hkv, hd]
    kv_dtype: torch.dtype | None = None  # the element type of a mimw cache holding them (None: k's dtype)


def decode_inputs(spec: ModelSpec, context: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cuda", kv_dtype: torch.dtype | None = None) -> DecodeInputs:
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    g = torch.Generator(device=device).manual_seed(seed * 7919 + context)
    shape = (spec.num_layers, context, spec.num_kv_heads, spec.head_dim)
    k = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 1.0, generator=g)
    v = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 1.0, generator=g)
    token = int(torch.randint(1, spec.vocab_size, (1,), generator=torch.Generator().manual_seed(seed + context)))
    if kv_dtype == fp8.FP8:
        k, v = (fp8.dequantize(*fp8.quantize(t)) for t in (k, v))
    elif kv_dtype is not None and kv_dtype != dtype:
        raise ValueError(f"decode inputs: a {kv_dtype} KV cache with {dtype} activations is not supported")
    return DecodeInputs(token, context, k, v, kv_dtype)


def paged_cache(spec: ModelSpec, inputs: DecodeInputs, page_size: int = 16) -> tuple[PagedKVCache, tuple[int, ...]]:
    """A ``PagedKVCache`` of ``inputs.kv_dtype`` holding ``inputs`` (room for position C too) and the sequence's
    block table."""
    c = inputs.context
    layout = KVLayout.for_spec(spec, page_size, max(1, -(-(c + 1) // page_size)), inputs.kv_dtype or inputs.k.dtype)
    cache = PagedKVCache(layout, device=inputs.k.device)
    p = layout.num_pages
    if layout.quantized:  # row by row through the cache's own quantiser
        pages, rows = cache.slots(tuple(range(p)), torch.arange(c, device=inputs.k.device))
        for layer in range(spec.num_layers):
            cache.store("k", layer, pages, rows, inputs.k[layer])
            cache.store("v", layer, pages, rows, inputs.v[layer])
        return cache, tuple(range(p))
    for dst, src in ((cache.k, inputs.k), (cache.v, inputs.v)):
        padded = torch.zeros((spec.num_layers, p * page_size, spec.num_kv_heads, spec.head_dim),
                             dtype=src.dtype, device=src.device)
        padded[:, :c] = src
        # [L, P*ps, Hkv, hd] -> [L, P, ps, Hkv, hd] -> [L, P, Hkv, ps, hd]
        dst.copy_(padded.view(spec.num_layers, p, page_size, spec.num_kv_heads, spec.head_dim).transpose(2, 3))
    return cache, tuple(range(p))


@torch.no_grad()
def reference_logits(weights: ModelWeights, inputs: DecodeInputs, routings: list | None = None,
                     route: Callable | None = None) -> torch.Tensor:
    """[vocab] fp32 logits of the reference decoder for the step (on the weights' device and dtype); ``routings``
    receives an MoE model's routing of the step, one per MoE layer (what its floor counts); ``route(layer, own
    routing)``: the routing an MoE layer runs instead of its own (``ReferenceDecoder.forward``)."""
    cache, table = paged_cache(weights.spec, inputs)
    tok = torch.tensor([inputs.token], device=weights.device)
    return ReferenceDecoder(weights).forward(tok, [Segment(table, inputs.context, 1)], cache, routings=routings,
                                             route=route)[0]


@torch.no_grad()
def fp32_reference_logits(weights: ModelWeights, inputs: DecodeInputs, routings: list | None = None,
                          route: Callable | None = None) -> torch.Tensor:
    """The same step with weights, cache and activations upcast to fp32 (a temporary 2x copy of the weights):
    the yardstick for how far bf16 rounding alone moves the logits (an MoE model's: over the bf16 step's routing,
    passed as ``route``, so that a near-tie routed elsewhere is not counted as rounding)."""
    w32 = weights.to(dtype=torch.float32)
    up = DecodeInputs(inputs.token, inputs.context, inputs.k.float(), inputs.v.float())  # fp8: the exact values
    return reference_logits(w32, up, routings, route)
