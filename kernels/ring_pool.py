"""A gated compressor's step inside the decode graph (engine/compress_step.py) in two launches instead of ~9.

Contract, for T rows of width W (fp32 rings, rows of the flat ring arenas):
    ring_write(kv, gate, ring_kv, ring_g, dst_kv, dst_g): ring_kv[dst_kv[t]] = kv[t], ring_g[dst_g[t]] = gate[t]
        (kv, gate [T, W] of any float dtype, rows at any stride: column blocks of a wider product), as fp32;
    ring_pool(ring_kv, ring_g, grp_kv, grp_g, dtype) -> pooled [T, W] in `dtype`:
        pooled[t] = sum_j ring_kv[grp_kv[t, j]] * softmax_j(ring_g[grp_g[t, j]])   (j < r, per channel, fp32)
The pool reads rows the write stored (a row's group holds the step's earlier rows), so they are two launches.

Why: the torch form is two dtype conversions, two index_copy, two gathers, a softmax, a product, a sum and a
conversion back: ~9 launches per gated layer, each a few microseconds for T x W = 8 x 512 values.
Cost: 2 T W elements written by the first launch; T r W x 2 read and T W written by the second.
Programmatic dependent launch (session 12): both wait first. H200 (a step at 64 rows of 512, groups of 4; 16
write + pool pairs back to back in a CUDA graph; us a pair, off -> on): R3 (benchmarks/kernels_moe.py's pdl sweep)
3.16 / 3.16 -> 2.69 / 2.69; R2 3.40 / 3.38 -> 2.91 / 2.92.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import check, empty, pdl_kw, pdl_wait, use_triton


def ring_write_torch(kv, gate, ring_kv, ring_g, dst_kv, dst_g) -> None:
    """The twin (and the CPU path)."""
    ring_kv.index_copy_(0, dst_kv, kv.float())
    ring_g.index_copy_(0, dst_g, gate.float())


def ring_pool_torch(ring_kv, ring_g, grp_kv, grp_g, dtype) -> torch.Tensor:
    """The twin (and the CPU path)."""
    return (ring_kv[grp_kv] * ring_g[grp_g].softmax(dim=1)).sum(dim=1).to(dtype)


@triton.jit
def _ring_write_kernel(kv_ptr, g_ptr, rkv_ptr, rg_ptr, dkv_ptr, dg_ptr, W, kv_stride, g_stride,
                       BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    ok = w < W
    pdl_wait(PDL)
    kv = tl.load(kv_ptr + t * kv_stride + w, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * g_stride + w, mask=ok, other=0.0).to(tl.float32)
    tl.store(rkv_ptr + tl.load(dkv_ptr + t) * W + w, kv, mask=ok)
    tl.store(rg_ptr + tl.load(dg_ptr + t) * W + w, g, mask=ok)


@triton.jit
def _ring_pool_kernel(rkv_ptr, rg_ptr, gkv_ptr, gg_ptr, out_ptr, W, R: tl.constexpr, RP: tl.constexpr,
                      BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, RP)
    pdl_wait(PDL)
    w = tl.arange(0, BLOCK_W)
    jok = j < R
    ok = jok[:, None] & (w < W)[None, :]
    rows_kv = tl.load(gkv_ptr + t * R + j, mask=jok, other=0)
    rows_g = tl.load(gg_ptr + t * R + j, mask=jok, other=0)
    kv = tl.load(rkv_ptr + rows_kv[:, None] * W + w[None, :], mask=ok, other=0.0)
    g = tl.load(rg_ptr + rows_g[:, None] * W + w[None, :], mask=ok, other=0.0)
    g = tl.where(jok[:, None], g, float("-inf"))       # (padding members weigh nothing; padding channels stay finite)
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    p = e / tl.sum(e, axis=0)[None, :]
    tl.store(out_ptr + t * W + w, tl.sum(kv * p, axis=0).to(out_ptr.dtype.element_ty), mask=w < W)


def ring_write_triton(kv, gate, ring_kv, ring_g, dst_kv, dst_g) -> None:
    """The write kernel: same contract as `ring_write_torch`."""
    T, W = kv.shape
    check(gate.shape == (T, W) and ring_kv.shape[1] == W and ring_g.shape[1] == W and ring_kv.is_contiguous()
          and ring_g.is_contiguous() and ring_kv.dtype == ring_g.dtype == torch.float32
          and dst_kv.shape == (T,) and dst_g.shape == (T,),
          f"ring_write: kv {tuple(kv.shape)}, gate {tuple(gate.shape)} into rings {tuple(ring_kv.shape)} / "
          f"{tuple(ring_g.shape)} at rows {tuple(dst_kv.shape)} / {tuple(dst_g.shape)} (want contiguous fp32 rings)")
    kvc = kv if kv.stride(1) == 1 else kv.contiguous()
    gc = gate if gate.stride(1) == 1 else gate.contiguous()
    if T:
        _ring_write_kernel[(T,)](kvc, gc, ring_kv, ring_g, dst_kv, dst_g, W, kvc.stride(0), gc.stride(0),
                                 BLOCK_W=triton.next_power_of_2(W), **pdl_kw())


def ring_pool_triton(ring_kv, ring_g, grp_kv, grp_g, dtype) -> torch.Tensor:
    """The pool kernel: same contract as `ring_pool_torch`."""
    T, R = grp_kv.shape
    W = ring_kv.shape[1]
    check(grp_g.shape == (T, R) and ring_g.shape[1] == W and ring_kv.is_contiguous() and ring_g.is_contiguous(),
          f"ring_pool: groups {tuple(grp_kv.shape)} / {tuple(grp_g.shape)} over rings {tuple(ring_kv.shape)} / "
          f"{tuple(ring_g.shape)}")
    out = empty((T, W), dtype, ring_kv.device)
    if T:
        BLOCK_W = triton.next_power_of_2(W)
        _ring_pool_kernel[(T,)](ring_kv, ring_g, grp_kv.contiguous(), grp_g.contiguous(), out, W, R=R,
                                RP=max(2, triton.next_power_of_2(R)), BLOCK_W=BLOCK_W,
                                num_warps=4 if BLOCK_W <= 1024 else 8, **pdl_kw())
    return out


def ring_write(kv, gate, ring_kv, ring_g, dst_kv, dst_g) -> None:
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(ring_kv):
        return ring_write_triton(kv, gate, ring_kv, ring_g, dst_kv, dst_g)
    return ring_write_torch(kv, gate, ring_kv, ring_g, dst_kv, dst_g)


def ring_pool(ring_kv, ring_g, grp_kv, grp_g, dtype) -> torch.Tensor:
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(ring_kv):
        return ring_pool_triton(ring_kv, ring_g, grp_kv, grp_g, dtype)
    return ring_pool_torch(ring_kv, ring_g, grp_kv, grp_g, dtype)
