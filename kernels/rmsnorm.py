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
Two norms of the same rows in one launch (`rms_norm_pair`, session 14: the attention's q_norm and its window kv
store read column blocks of the one stacked wq_a + wkv product): H200 R1, the mid-size shapes (q 768, kv 512 with
64 rotated channels and the slab scatter), 16 calls in a CUDA graph, us a call with the stacked product before
(and wq_b after): T = 64 two launches 8.95-9.15 (17.89-17.95), one 8.42-8.48 (17.43-17.46); T = 8 8.75-8.93
(17.45-17.47) against 8.22-8.26 (16.97-16.98); the same bits at these widths (not in general: `rms_norm_pair`).
R2, T = 64: 9.20-9.22 against 8.45-8.59, but with wq_b after 18.39-18.52 against 19.05-19.23 (not settled: the whole
step decides).
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
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, turn_ptr, dst_ptr, D, x_row_stride, eps, xa_ptr, wa_ptr, oa_ptr, DA,
                     xa_row_stride, eps_a, R: tl.constexpr, ROPE: tl.constexpr, SCATTER: tl.constexpr,
                     BLOCK_D: tl.constexpr, EARLY: tl.constexpr, PAIR: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (rows, 1 + PAIR): the programs of column 1 (PAIR) norm their row of the second input (xa, wa -> oa:
    no rotation, no scatter) instead. PDL: everything after the wait (even the weight: its fp32 copy may be the
    previous kernel's output, on the first call); EARLY (one wave of programs): the next kernel may launch at once
    (its programs wait for ours)."""
    row = tl.program_id(0).to(tl.int64)
    first = True
    if PAIR:
        first = tl.program_id(1) == 0
    if first:
        xr, wp, n, e = x_ptr + row * x_row_stride, w_ptr, D, eps
    else:
        xr, wp, n, e = xa_ptr + row * xa_row_stride, wa_ptr, DA, eps_a
    d = tl.arange(0, BLOCK_D)
    ok = d < n
    pdl_wait(PDL)
    if EARLY:
        pdl_trigger(PDL)
    x = tl.load(xr + d, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + e)
    w = tl.load(wp + d, mask=ok, other=0.0)
    y = x * r * w
    if ROPE:     # then kernels/rope.py's rotation of the last R channels, on the norm's output rounded as stored
        rot = ok & (d >= D - R)
        if PAIR:
            rot = rot & first
        p = tl.load(xr + (d ^ 1), mask=rot, other=0.0).to(tl.float32)
        pw = tl.load(wp + (d ^ 1), mask=rot, other=0.0)
        a = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        b = (p * r * pw).to(out_ptr.dtype.element_ty).to(tl.float32)
        j = tl.where(rot, (d - (D - R)) // 2, 0)
        c = tl.load(turn_ptr + (row * (R // 2) + j) * 2, mask=rot, other=1.0)
        s = tl.load(turn_ptr + (row * (R // 2) + j) * 2 + 1, mask=rot, other=0.0)
        y = tl.where(rot, tl.where((d % 2) == 1, b * s + a * c, a * c - b * s), y)
    dst = row
    if SCATTER:  # the row's destination in `out` (e.g. its slot in the window slab)
        if first:    # (int64 as `row`: with PAIR both branches of this run-time `if` must agree)
            dst = tl.load(dst_ptr + row).to(tl.int64)
    if first:
        op = out_ptr + dst * D
    else:
        op = oa_ptr + row * DA
    tl.store(op + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, turn: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, rows: torch.Tensor | None = None, also: tuple | None = None):
    """The kernel: same contract as `rms_norm_torch` (weight fp32 [D]; turn, out, rows as `rms_norm`). also = (xa,
    wa, eps_a): a second norm of the same rows in the same launch (`rms_norm_pair`); then -> (out, xa's norm)."""
    D = x.shape[-1]
    check(weight.shape == (D,), f"rms_norm: weight of shape {tuple(weight.shape)} for x of shape {tuple(x.shape)}")
    check(weight.dtype == torch.float32, f"rms_norm: weight dtype {weight.dtype} (want float32)")
    check(D <= 16384, f"rms_norm: rows of {D} channels (at most 16384 in one program)")
    xc = _rows(x)
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
    xa = wa = oa = None
    DA, eps_a = 0, 0.0
    if also is not None:
        xa, wa, eps_a = also
        DA = xa.shape[-1]
        check(xa.numel() == n * DA and xa.dtype == x.dtype and wa.shape == (DA,) and wa.dtype == torch.float32
              and 0 < DA <= 16384,
              f"rms_norm: the second norm's x {xa.dtype} {tuple(xa.shape)} with weight {wa.dtype} "
              f"{tuple(wa.shape)} for {n} rows of {x.dtype} (want {n} rows of x's dtype, an fp32 weight)")
        xa = _rows(xa)
        oa = empty(xa.shape if xa.dim() > 1 else (n, DA), x.dtype, x.device)
    if n:
        BLOCK_D = triton.next_power_of_2(max(D, DA))
        pair = also is not None
        _rms_norm_kernel[(n, 1 + pair)](
            xc, weight.contiguous(), out, turn.contiguous() if turn is not None else weight,
            rows if rows is not None else weight, D, _row_stride(xc, D), eps, xa if pair else xc,
            wa.contiguous() if pair else weight, oa if pair else out, DA, _row_stride(xa, DA) if pair else 0, eps_a,
            R=R, ROPE=turn is not None, SCATTER=rows is not None, BLOCK_D=BLOCK_D, PAIR=pair,
            EARLY=one_wave(n * (1 + pair), x.device), num_warps=4 if BLOCK_D <= 2048 else 8, **pdl_kw())
    return out if also is None else (out, oa)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: rows of a 2-d x at their stride (a column block of a wider GEMM output needs no
    copy), anything else contiguous."""
    return x if x.dim() == 2 and x.stride(-1) == 1 else x.contiguous()


def _row_stride(x: torch.Tensor, D: int) -> int:
    return x.stride(0) if x.dim() == 2 else D


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


def rms_norm_pair(xa: torch.Tensor, wa: torch.Tensor, eps_a: float, x: torch.Tensor, weight: torch.Tensor,
                  eps: float, turn: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(xa, wa, eps_a), rms_norm(x, weight, eps, turn, out, rows)) in one launch on CUDA: two norms of
    the same rows (the attention's q_norm and its window kv store, both reading the stacked projection's column
    blocks), one launch fewer; xa's norm takes neither rotation nor scatter. Elsewhere the two twins.
    The two launches' bits where the one launch reduces each norm's sum of squares in its own launch's order (the
    mid-size widths, q 768 / kv 512, measured on the H200); not promised in general: the launch's block width and
    warps are the wider norm's (8 warps above 2048 channels), and the narrower norm's sum may then be reduced in
    another order (a last-bit difference)."""
    if (use_triton(x) and weight.dtype == torch.float32 and wa.dtype == torch.float32 and xa.dtype == x.dtype
            and max(x.shape[-1], xa.shape[-1]) <= 16384):
        y, ya = rms_norm_triton(x, weight, eps, turn, out, rows, also=(xa, wa, eps_a))
        return ya, y
    return rms_norm(xa, wa, eps_a), rms_norm(x, weight, eps, turn, out, rows)
