"""Engram's device half in two launches: decode the table rows, and gate the projected value into the streams.

Contract (engine/engram.py `Engram.mix`, around its one GEMM):
    unpack_rows(packed [N, W + W/32] uint8, W, dtype) -> [N, W] dtype: FP8 E4M3 bytes times 2^(scale byte - 127)
        per 32 values (the table's stored bytes, exact in bf16 / fp32);
    engram_gate(R [T, M, H], kv [T, (M+1) H], w [M, H] fp32, eps) -> R' [T, M, H] in R's dtype, with
        r = R (fp32), key_m = kv[:, m H:(m+1) H], value = kv[:, M H:] (as fp32),
        d_m = <r_m, w_m * key_m> * rsqrt(mean(r_m^2) + eps) * rsqrt(mean(key_m^2) + eps) / sqrt(H),
        gate_m = sigmoid(sign(d_m) sqrt(max(|d_m|, 1e-6))),   R'_m = r_m + gate_m * value.
Why: the torch form is ~40 launches per Engram layer (byte slicing, the scale exponents, products, norms, signs,
square roots, the sigmoid, the write-back), each a few microseconds at decode sizes: R1 of session 7, mid-size V4.1,
batch 8: 86 launches and 210 us for the two Engram layers, 65 us of it the GEMM.
Cost: unpack N (W + W/32) bytes read, N W written; gate 2 T M H + T (M+1) H elements read, T M H written; one
program per table row / per (token, stream).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import check, empty, use_triton

GROUP = 32      # values per UE8M0 scale byte


def unpack_rows_torch(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The twin (and the CPU path)."""
    w = packed[..., :width].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    s = torch.exp2(packed[..., width:].to(torch.float32) - 127.0).repeat_interleave(GROUP, dim=-1)[..., :width]
    return (w * s).to(dtype)


def engram_gate_torch(R: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin (and the CPU path)."""
    t, m, h = R.shape
    kv = kv.float()
    key = kv[:, : m * h].view(t, m, h)
    value = kv[:, m * h:]
    r = R.float()
    dot = (r * w * key).sum(-1)
    dot = dot * torch.rsqrt(r.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / math.sqrt(h)
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())   # [T, M]
    return (r + gate[..., None] * value[:, None, :]).to(R.dtype)


@triton.jit
def _unpack_kernel(p_ptr, out_ptr, W, row_bytes, BLOCK_W: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_W)
    ok = i < W
    b = tl.load(p_ptr + n * row_bytes + i, mask=ok, other=0).to(tl.int32)
    s = tl.load(p_ptr + n * row_bytes + W + i // 32, mask=ok, other=127).to(tl.int32)
    e, m = (b >> 3) & 15, b & 7
    # E4M3 by its bits: normal (1 + m/8) 2^(e-7), subnormal m/8 2^-6, the one NaN code (e = 15, m = 7)
    normal = ((b >> 7) << 31 | (e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
    sub = tl.where((b >> 7) == 1, -1.0, 1.0) * m.to(tl.float32) * 0.001953125
    v = tl.where(e == 0, sub, tl.where((e == 15) & (m == 7), float("nan"), normal))
    scale = (s << 23).to(tl.float32, bitcast=True)                       # 2^(s - 127), exactly
    tl.store(out_ptr + n * W + i, (v * scale).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_kernel(r_ptr, kv_ptr, w_ptr, out_ptr, H, M, kv_stride, eps, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    ok = h < H
    r = tl.load(r_ptr + (t * M + m) * H + h, mask=ok, other=0.0).to(tl.float32)
    key = tl.load(kv_ptr + t * kv_stride + m * H + h, mask=ok, other=0.0).to(tl.float32)
    value = tl.load(kv_ptr + t * kv_stride + M * H + h, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + m * H + h, mask=ok, other=0.0)
    dot = tl.sum(r * w * key, axis=0)
    dot = dot / tl.sqrt(tl.sum(r * r, axis=0) / H + eps) / tl.sqrt(tl.sum(key * key, axis=0) / H + eps) / tl.sqrt(
        H.to(tl.float32))
    sgn = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    z = sgn * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-z))
    tl.store(out_ptr + (t * M + m) * H + h, (r + gate * value).to(out_ptr.dtype.element_ty), mask=ok)


def unpack_rows_triton(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The decode kernel: same contract as `unpack_rows_torch` (any leading shape)."""
    check(packed.dtype == torch.uint8 and packed.shape[-1] == width + -(-width // GROUP),
          f"unpack_rows: {packed.dtype} rows of {packed.shape[-1]} bytes for width {width} (want uint8, "
          f"{width} + {-(-width // GROUP)} scale bytes)")
    p = packed.contiguous()
    out = empty((*packed.shape[:-1], width), dtype, packed.device)
    n = p.numel() // max(p.shape[-1], 1)
    if n:
        _unpack_kernel[(n,)](p, out, width, p.shape[-1], BLOCK_W=triton.next_power_of_2(width))
    return out


def engram_gate_triton(R: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The gate kernel: same contract as `engram_gate_torch` (kv rows at any stride)."""
    T, M, H = R.shape
    check(kv.dim() == 2 and kv.shape == (T, (M + 1) * H) and w.shape == (M, H) and w.dtype == torch.float32,
          f"engram_gate: R {tuple(R.shape)}, kv {tuple(kv.shape)}, w {w.dtype} {tuple(w.shape)} (want kv "
          f"[{T}, {(M + 1) * H}], w fp32 [{M}, {H}])")
    Rc = R.contiguous()
    kvc = kv if kv.stride(1) == 1 else kv.contiguous()
    out = empty(R.shape, R.dtype, R.device)
    if T:
        BLOCK_H = triton.next_power_of_2(H)
        _gate_kernel[(T, M)](Rc, kvc, w.contiguous(), out, H, M, kvc.stride(0), float(eps), BLOCK_H=BLOCK_H,
                             num_warps=4 if BLOCK_H <= 1024 else 8)
    return out


def unpack_rows(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(packed):
        return unpack_rows_triton(packed, width, dtype)
    return unpack_rows_torch(packed, width, dtype)


def engram_gate(R: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(R):
        return engram_gate_triton(R, kv, w, eps)
    return engram_gate_torch(R, kv, w, eps)
