"""RMSNorm as DeepSeek-V4 computes it, in one launch: statistics and the weight product in fp32, one cast back.

out[row] = (x * rsqrt(mean(x^2) + eps) * w) in x's dtype, x [..., D] of any float dtype, w fp32 [D].

Why a kernel: the torch form (the twin) is a cast of x to fp32, PyTorch's fused rms_norm, and a cast back: three
launches, and the decode step runs ~100 norms (attention / MoE inputs, q / kv / index-key / compressor norms of
every layer) inside its CUDA graph, each a few microseconds for a few KB. One launch reads x once, writes once.
Optionally, in the same launch, RoPE on the result (the window KV: kv_norm then rope) and a scatter of each row to
its own destination row (the window slab: no separate index_copy); see `rms_norm`.
Cost: 2 * numel elements moved; one program per row (rows of up to 16,384 channels). Measured in the mid-size
V4.1 decode step (H200, batch 8, R1 of session 6): 87 calls of 1.7 us each, replacing 3 launches per norm.
Programmatic dependent launch (session 12, `_rms_norm_kernel`'s docstring): H200 R3, 64 rows of 2048, 16 calls
back to back in a CUDA graph (benchmarks/kernels_moe.py's pdl sweep), us, off -> on: 1.74 / 1.72 -> 1.28 / 1.26
(R1 / R2's .round script: 1.84 / 1.83 -> 1.40 / 1.38).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import check, empty, one_wave, pdl_kw, pdl_trigger, pdl_wait, use_triton
from .rope import apply_rope_torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin (and the CPU path)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, turn_ptr, dst_ptr, D, x_row_stride, eps, R: tl.constexpr,
                     ROPE: tl.constexpr, SCATTER: tl.constexpr, BLOCK_D: tl.constexpr, EARLY: tl.constexpr,
                     PDL: tl.constexpr = False):
    """PDL: everything after the wait (even the weight: its fp32 copy may be the previous kernel's output, on the
    first call); EARLY (one wave of programs): the next kernel may launch at once (its programs wait for ours)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    pdl_wait(PDL)
    if EARLY:
        pdl_trigger(PDL)
    x = tl.load(x_ptr + row * x_row_stride + d, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    y = x * r * w
    if ROPE:     # then kernels/rope.py's rotation of the last R channels, on the norm's output rounded as stored
        rot = ok & (d >= D - R)
        p = tl.load(x_ptr + row * x_row_stride + (d ^ 1), mask=rot, other=0.0).to(tl.float32)
        pw = tl.load(w_ptr + (d ^ 1), mask=rot, other=0.0)
        a = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        b = (p * r * pw).to(out_ptr.dtype.element_ty).to(tl.float32)
        j = tl.where(rot, (d - (D - R)) // 2, 0)
        c = tl.load(turn_ptr + (row * (R // 2) + j) * 2, mask=rot, other=1.0)
        s = tl.load(turn_ptr + (row * (R // 2) + j) * 2 + 1, mask=rot, other=0.0)
        y = tl.where(rot, tl.where((d % 2) == 1, b * s + a * c, a * c - b * s), y)
    dst = row
    if SCATTER:  # the row's destination in `out` (e.g. its slot in the window slab)
        dst = tl.load(dst_ptr + row)
    tl.store(out_ptr + dst * D + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, turn: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel: same contract as `rms_norm_torch` (weight fp32 [D]; turn, out, rows as `rms_norm`)."""
    D = x.shape[-1]
    check(weight.shape == (D,), f"rms_norm: weight of shape {tuple(weight.shape)} for x of shape {tuple(x.shape)}")
    check(weight.dtype == torch.float32, f"rms_norm: weight dtype {weight.dtype} (want float32)")
    check(D <= 16384, f"rms_norm: rows of {D} channels (at most 16384 in one program)")
    # rows of a 2-d x are read at their stride (a column block of a wider GEMM output needs no copy)
    xc = x if x.dim() == 2 and x.stride(-1) == 1 else x.contiguous()
    n = x.numel() // max(D, 1)
    R = 0
    if turn is not None:
        R = turn.shape[1] * 2
        check(turn.dim() == 3 and turn.shape[0] == n and turn.shape[2] == 2 and turn.dtype == torch.float32
              and 0 < R <= D and (D - R) % 2 == 0,
              f"rms_norm: turn {turn.dtype} {tuple(turn.shape)} for {n} rows of {D} (want fp32 [{n}, R/2, 2])")
    if rows is not None:
        check(out is not None and out.dim() == 2 and out.shape[1] == D and out.is_contiguous()
              and rows.shape == (n,) and out.dtype == x.dtype,
              f"rms_norm: rows {tuple(rows.shape)} into out {None if out is None else tuple(out.shape)} for "
              f"{n} rows of {D} (want a contiguous [P, {D}] out of x's dtype)")
    else:
        out = empty(x.shape, x.dtype, x.device)
    if n:
        BLOCK_D = triton.next_power_of_2(D)
        _rms_norm_kernel[(n,)](xc, weight.contiguous(), out, turn.contiguous() if turn is not None else weight,
                               rows if rows is not None else weight, D, xc.stride(0) if xc.dim() == 2 else D, eps,
                               R=R, ROPE=turn is not None, SCATTER=rows is not None, BLOCK_D=BLOCK_D,
                               EARLY=one_wave(n, x.device), num_warps=4 if BLOCK_D <= 2048 else 8, **pdl_kw())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, turn: torch.Tensor | None = None,
             out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the kernel on CUDA, the twin elsewhere. turn fp32 [n, R/2, 2]: then rotate the last R channels as
    kernels/rope.py does (on the norm's output as rounded to x's dtype). rows int64 [n] with out [P, D]: write row i
    to out[rows[i]] (e.g. the window slab) and return out. Both in the same one launch."""
    if use_triton(x) and weight.dtype == torch.float32 and x.shape[-1] <= 16384:
        return rms_norm_triton(x, weight, eps, turn, out, rows)
    y = rms_norm_torch(x, weight, eps)
    if turn is not None:
        y = apply_rope_torch(y, turn)
    if rows is None:
        return y
    out.index_copy_(0, rows, y.reshape(-1, x.shape[-1]))
    return out
