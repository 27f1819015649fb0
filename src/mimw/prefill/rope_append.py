"""The QKV GEMM's epilogue: per-head RMSNorm of q and k (qwen3), RoPE on q and k, and the K/V append into the paged
cache, in one pass over the [T, Q+2KV] GEMM output.

Numerics are the reference decoder's (``mimw.models.reference``, ``mimw.models.rope``): the head norm in fp32, cast
to the activation dtype, times its weight (rounded); RoPE in fp32 from the fp32 cos/sin tables (HF ``rotate_half``
pairing: element i with element i + hd/2), rounded to the activation dtype; K/V stored in the cache's dtype at
``slots`` (page * page_size + row, ``PrefillBatch.slots``) in the ``mimw.kv.pages`` layout [P, Hkv, PS, hd].

``rope_append`` is the Triton kernel: one program per (block of tokens, head), q heads first, then kv heads (which
also copy their v head). ``rope_append_torch`` does the same with the reference's functions, on any device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..models import rope
from ..models.reference import rms_norm

BLOCK_T = 32


@triton.jit
def _rope_append_kernel(QKV, Q_OUT, K_CACHE, V_CACHE, SLOTS, COS, SIN, QN, KN,
                        T, stride_qkv, stride_qt, stride_qh, eps,
                        HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, PS: tl.constexpr,
                        QK_NORM: tl.constexpr, BLOCK_T: tl.constexpr):
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
        off = (((slot // PS) * HKV + kvh) * PS + slot % PS) * HD  # int64: slots are int64
        kd = K_CACHE + off[:, None]
        tl.store(kd + j[None, :], ra.to(K_CACHE.dtype.element_ty), mask=m2)
        tl.store(kd + HALF + j[None, :], rb.to(K_CACHE.dtype.element_ty), mask=m2)
        d = tl.arange(0, HD)
        v = tl.load(row + (HQ + HKV + kvh) * HD + d[None, :], mask=m2, other=0.0)
        tl.store(V_CACHE + off[:, None] + d[None, :], v.to(V_CACHE.dtype.element_ty), mask=m2)


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_layer: torch.Tensor,
                v_layer: torch.Tensor, slots: torch.Tensor, num_heads: int, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """qkv [T, Q+2KV]; cos, sin [T, hd/2] fp32; k_layer, v_layer [P, Hkv, PS, hd] (written at ``slots`` [T] int64)
    -> q [T, Hq, hd] after its norm and RoPE."""
    t = qkv.shape[0]
    _, hkv, ps, hd = k_layer.shape
    if qkv.stride(1) != 1 or not (k_layer.is_contiguous() and v_layer.is_contiguous()):
        raise ValueError("rope_append needs a row-major qkv and contiguous cache layers")
    if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rope_append needs contiguous fp32 cos/sin tables")
    q = torch.empty(t, num_heads, hd, dtype=qkv.dtype, device=qkv.device)
    if t:
        qn = q_norm if q_norm is not None else cos  # unread unless QK_NORM
        kn = k_norm if k_norm is not None else cos
        _rope_append_kernel[(triton.cdiv(t, BLOCK_T), num_heads + hkv)](
            qkv, q, k_layer, v_layer, slots, cos, sin, qn, kn, t, qkv.stride(0), q.stride(0), q.stride(1), eps,
            HQ=num_heads, HKV=hkv, HD=hd, PS=ps, QK_NORM=q_norm is not None, BLOCK_T=BLOCK_T, num_warps=4)
    return q


def rope_append_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_layer: torch.Tensor,
                      v_layer: torch.Tensor, slots: torch.Tensor, num_heads: int, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``rope_append`` with the reference decoder's functions (any device)."""
    t = qkv.shape[0]
    _, hkv, ps, hd = k_layer.shape
    q, k, v = qkv.split([num_heads * hd, hkv * hd, hkv * hd], dim=-1)
    q, k, v = q.reshape(t, num_heads, hd), k.reshape(t, hkv, hd), v.reshape(t, hkv, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    pages, rows = slots // ps, slots % ps
    k_layer[pages, :, rows] = k.to(k_layer.dtype)
    v_layer[pages, :, rows] = v.to(v_layer.dtype)
    return q.contiguous()
