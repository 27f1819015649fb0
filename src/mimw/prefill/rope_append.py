"""The QKV GEMM's epilogue: per-head RMSNorm of q and k (qwen3), RoPE on q and k, and the K/V append into the paged
cache, in one pass over the [T, Q+2KV] GEMM output.

Numerics are the reference decoder's (``mimw.models.reference``, ``mimw.models.rope``): the head norm in fp32, cast
to the activation dtype, times its weight (rounded); RoPE in fp32 from the fp32 cos/sin tables (HF ``rotate_half``
pairing: element i with element i + hd/2), rounded to the activation dtype; K/V stored in the cache's dtype at
``slots`` (page * page_size + row, ``PrefillBatch.slots``) in the ``mimw.kv.pages`` layout [P, Hkv, PS, hd].

Over an fp8 cache (``k_scale``, ``v_scale`` [P, Hkv, PS] bf16 given) each K and V row of a head is quantised as
``mimw.kv.fp8.quantize`` does, from the row the bf16 path would store, in this order:

    k = RoPE(norm(k)) rounded to the activation dtype (v: the GEMM output as it is), widened to fp32
    amax = max |k_i|;  scale = bf16(max(amax / 448, 2^-126)), 1 where amax == 0   (IEEE division, round to even)
    q_i = e4m3(clamp(k_i / scale, -448, 448))                                     (IEEE division, round to even)

so the stored bytes and scales are ``fp8.quantize``'s bit for bit (``rope_append_torch`` calls it: the reference).
The kernel divides with ``tl.div_rn`` (correctly rounded, as torch's ``/``; Triton's ``/`` may not be).

``rope_append`` is the Triton kernel: one program per (block of tokens, head), q heads first, then kv heads (which
also copy their v head). ``rope_append_torch`` does the same with the reference's functions, on any device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv import fp8
from ..models import rope
from ..models.reference import rms_norm

BLOCK_T = 32
_E4M3_MAX = tl.constexpr(fp8.E4M3_MAX)
_MIN_SCALE = tl.constexpr(2.0 ** -126)  # fp8.row_scale's floor: bf16's smallest normal


@triton.jit
def _row_scale(amax):
    """fp8.row_scale: fp32 amax [BLOCK_T] -> bf16 scales."""
    s = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32)), _MIN_SCALE)
    return tl.where(amax > 0, s, 1.0).to(tl.bfloat16)


@triton.jit
def _e4m3(x, scale):
    """fp8.quantize's values: fp32 x [BLOCK_T, n] over its rows' bf16 scales [BLOCK_T] -> e4m3."""
    y = tl.div_rn(x, tl.broadcast_to(scale.to(tl.float32)[:, None], x.shape))
    return tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX).to(tl.float8e4nv)


@triton.jit
def _rope_append_kernel(QKV, Q_OUT, K_CACHE, V_CACHE, K_SCALE, V_SCALE, SLOTS, COS, SIN, QN, KN,
                        T, stride_qkv, stride_qt, stride_qh, eps,
                        HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, PS: tl.constexpr,
                        QK_NORM: tl.constexpr, FP8: tl.constexpr, BLOCK_T: tl.constexpr):
    HALF: tl.constexpr = HD // 2
    h = tl.program_id(1)  # q heads 0..HQ-1, then kv heads; head h's columns start at h * HD either way
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    j = tl.arange(0, HALF)
    m2 = mt[:, None]
    row = QKV + t.to(tl.int64)[:, None] * stride_qkv
    a = tl.load(row + h * HD + j[None, :], mask=m2, other=0.0).to(tl.float32)  # [BLOCK_T, HALF]
    b = tl.load(row + h * HD + HALF + j[None, :], mask=m2, other=0.0).to(tl.float32)
    dt = QKV.dtype.element_ty
    if QK_NORM:
        r = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HD + eps)[:, None]
        if h < HQ:
            wa = tl.load(QN + j).to(tl.float32)[None, :]
            wb = tl.load(QN + HALF + j).to(tl.float32)[None, :]
        else:
            wa = tl.load(KN + j).to(tl.float32)[None, :]
            wb = tl.load(KN + HALF + j).to(tl.float32)[None, :]
        a = ((a * r).to(dt).to(tl.float32) * wa).to(dt).to(tl.float32)
        b = ((b * r).to(dt).to(tl.float32) * wb).to(dt).to(tl.float32)
    c = tl.load(COS + t[:, None] * HALF + j[None, :], mask=m2, other=0.0)
    s = tl.load(SIN + t[:, None] * HALF + j[None, :], mask=m2, other=0.0)
    ra = a * c - b * s
    rb = b * c + a * s
    if h < HQ:
        dst = Q_OUT + t.to(tl.int64)[:, None] * stride_qt + h * stride_qh
        tl.store(dst + j[None, :], ra.to(Q_OUT.dtype.element_ty), mask=m2)
        tl.store(dst + HALF + j[None, :], rb.to(Q_OUT.dtype.element_ty), mask=m2)
    else:
        kvh = h - HQ
        slot = tl.load(SLOTS + t, mask=mt, other=0)
        srow = ((slot // PS) * HKV + kvh) * PS + slot % PS  # the row's index in [P, Hkv, PS] (int64: slots are)
        off = srow * HD
        kd = K_CACHE + off[:, None]
        d = tl.arange(0, HD)
        v = tl.load(row + (HQ + HKV + kvh) * HD + d[None, :], mask=m2, other=0.0)
        if FP8:
            ka = ra.to(dt).to(tl.float32)  # the row the bf16 path stores, then fp8.quantize
            kb = rb.to(dt).to(tl.float32)
            ks = _row_scale(tl.maximum(tl.max(tl.abs(ka), axis=1), tl.max(tl.abs(kb), axis=1)))
            tl.store(kd + j[None, :], _e4m3(ka, ks), mask=m2)
            tl.store(kd + HALF + j[None, :], _e4m3(kb, ks), mask=m2)
            tl.store(K_SCALE + srow, ks, mask=mt)
            vf = v.to(tl.float32)
            vs = _row_scale(tl.max(tl.abs(vf), axis=1))
            tl.store(V_CACHE + off[:, None] + d[None, :], _e4m3(vf, vs), mask=m2)
            tl.store(V_SCALE + srow, vs, mask=mt)
        else:
            tl.store(kd + j[None, :], ra.to(K_CACHE.dtype.element_ty), mask=m2)
            tl.store(kd + HALF + j[None, :], rb.to(K_CACHE.dtype.element_ty), mask=m2)
            tl.store(V_CACHE + off[:, None] + d[None, :], v.to(V_CACHE.dtype.element_ty), mask=m2)


def _check_scales(k_layer: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """True for an fp8 layer (whose scales must come with it, [P, Hkv, PS] bf16), False for another dtype."""
    quantized = k_layer.dtype == fp8.FP8
    if quantized != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("an fp8 cache layer comes with its k_scale and v_scale, and only an fp8 one")
    if quantized and any(s.shape != k_layer.shape[:-1] or s.dtype != fp8.SCALE_DTYPE or not s.is_contiguous()
                         for s in (k_scale, v_scale)):
        raise ValueError(f"k_scale and v_scale must be contiguous {fp8.SCALE_DTYPE} of shape "
                         f"{tuple(k_layer.shape[:-1])} (one scale per page, head and row)")
    return quantized


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_layer: torch.Tensor,
                v_layer: torch.Tensor, slots: torch.Tensor, num_heads: int, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, Q+2KV]; cos, sin [T, hd/2] fp32; k_layer, v_layer [P, Hkv, PS, hd] (written at ``slots`` [T] int64;
    fp8 with their rows' scales ``k_scale``, ``v_scale`` [P, Hkv, PS] bf16) -> q [T, Hq, hd] after its norm and
    RoPE."""
    t = qkv.shape[0]
    _, hkv, ps, hd = k_layer.shape
    if qkv.stride(1) != 1 or not (k_layer.is_contiguous() and v_layer.is_contiguous()):
        raise ValueError("rope_append needs a row-major qkv and contiguous cache layers")
    quantized = _check_scales(k_layer, k_scale, v_scale)
    if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rope_append needs contiguous fp32 cos/sin tables")
    q = torch.empty(t, num_heads, hd, dtype=qkv.dtype, device=qkv.device)
    if t:
        qn = q_norm if q_norm is not None else cos  # unread unless QK_NORM
        kn = k_norm if k_norm is not None else cos
        ks = k_scale if quantized else cos  # unread unless FP8
        vs = v_scale if quantized else cos
        _rope_append_kernel[(triton.cdiv(t, BLOCK_T), num_heads + hkv)](
            qkv, q, k_layer, v_layer, ks, vs, slots, cos, sin, qn, kn, t, qkv.stride(0), q.stride(0), q.stride(1),
            eps, HQ=num_heads, HKV=hkv, HD=hd, PS=ps, QK_NORM=q_norm is not None, FP8=quantized, BLOCK_T=BLOCK_T,
            num_warps=4)
    return q


def rope_append_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_layer: torch.Tensor,
                      v_layer: torch.Tensor, slots: torch.Tensor, num_heads: int, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_append`` with the reference decoder's functions (any device); over an fp8 cache the rows are those
    of the bf16 path quantised by ``fp8.quantize`` (the fp8 definition the kernel matches bit for bit)."""
    t = qkv.shape[0]
    _, hkv, ps, hd = k_layer.shape
    quantized = _check_scales(k_layer, k_scale, v_scale)
    q, k, v = qkv.split([num_heads * hd, hkv * hd, hkv * hd], dim=-1)
    q, k, v = q.reshape(t, num_heads, hd), k.reshape(t, hkv, hd), v.reshape(t, hkv, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    pages, rows = slots // ps, slots % ps
    if quantized:
        for layer, scale, x in ((k_layer, k_scale, k), (v_layer, v_scale, v)):
            xq, xs = fp8.quantize(x)
            # through a byte view: index_put of float8 is not implemented on every device and torch version
            layer.view(torch.uint8)[pages, :, rows] = xq.view(torch.uint8)
            scale[pages, :, rows] = xs
    else:
        k_layer[pages, :, rows] = k.to(k_layer.dtype)
        v_layer[pages, :, rows] = v.to(v_layer.dtype)
    return q.contiguous()
