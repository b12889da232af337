"""Triton kernels behind predictor.fused_kernels.TritonKernels: one program per token row.

Imported only when the Triton implementation is chosen (Triton is optional). Rows may be strided
(q, k and v are column slices of one qkv output), elements within a row are contiguous. Every
kernel does its arithmetic in fp32 and stores in the tensor's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, H, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        # residual += x, rounded to the residual's dtype before the norm reads it (as torch's add_)
        r = tl.load(res_ptr + row * res_stride + cols, mask=m, other=0.0).to(tl.float32)
        s = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * res_stride + cols, s, mask=m)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * y).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_rows(ptr, stride, t, nh, c, s, HALF, h, d, dm):
    base = ptr + t * stride + h[:, None] * (2 * HALF) + d[None, :]
    mm = (h[:, None] < nh) & dm[None, :]
    x1 = tl.load(base, mask=mm, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mm, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c[None, :] - x2 * s[None, :]).to(ptr.dtype.element_ty), mask=mm)
    tl.store(base + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(ptr.dtype.element_ty), mask=mm)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_stride, k_stride, num_q_heads, num_kv_heads, HALF,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c = tl.load(cos_ptr + pos * HALF + d, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + d, mask=dm, other=0.0).to(tl.float32)
    h = tl.arange(0, BLOCK_H)
    _rope_rows(q_ptr, q_stride, t, num_q_heads, c, s, HALF, h, d, dm)
    _rope_rows(k_ptr, k_stride, t, num_kv_heads, c, s, HALF, h, d, dm)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, gu_stride, out_stride, FF, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < FF
    g = tl.load(gu_ptr + t * gu_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * gu_stride + FF + cols, mask=m, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * out_stride + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride, v_stride, KV_DIM, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < KV_DIM
    tl.store(kc_ptr + slot * KV_DIM + cols, tl.load(k_ptr + t * k_stride + cols, mask=m), mask=m)
    tl.store(vc_ptr + slot * KV_DIM + cols, tl.load(v_ptr + t * v_stride + cols, mask=m), mask=m)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    T, H = x.shape
    res = residual if residual is not None else x
    _rms_norm_kernel[(T,)](x, res, w, out, x.stride(0), res.stride(0), out.stride(0), H, eps,
                           HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(H))


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, Hq, d] and k [T, Hkv, d], rows strided, heads and elements contiguous; cos/sin [P, d/2]."""
    T, hq, d = q.shape
    _rope_kernel[(T,)](q, k, positions, cos, sin, q.stride(0), k.stride(0), hq, k.shape[1], d // 2,
                       BLOCK_H=triton.next_power_of_2(max(hq, k.shape[1])), BLOCK_D=triton.next_power_of_2(d // 2))


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    T, FF = out.shape
    block = min(1024, triton.next_power_of_2(FF))
    _silu_and_mul_kernel[(T, triton.cdiv(FF, block))](gate_up, out, gate_up.stride(0), out.stride(0), FF, BLOCK=block)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, d] (rows strided); caches [slots, Hkv, d] contiguous."""
    T = k.shape[0]
    kv_dim = k.shape[1] * k.shape[2]
    _write_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), kv_dim,
                           BLOCK=triton.next_power_of_2(kv_dim))
