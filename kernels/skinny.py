"""Products of a few rows with a large weight, `out = x @ w.T`, one program per BN output columns, weight streamed
once (decode-step GEMMs), optionally with V4's clamped SwiGLU of a second (up) product in the same launch.

Contract: x [T, G*K] (rows may be strided: a column block of a wider product), w [G*N, K] contiguous, G groups:
out[t, g*N + n] = sum_k x[t, g*K + k] * w[g*N + n, k] (G = 1: `F.linear(x, w)`; G > 1: block-diagonal per group).
fp32 accumulation, result in x's dtype [T, G*N]. `glu` = (w_up [N, K], limit), G = 1: out = silu(min(x w^T, L)) *
clamp(x w_up^T, -L, L), each product rounded to x's dtype first as separate launches store them: a shared
expert's front half (w1, w3, two clamps, silu, the product: 6 launches) in one.

Measured (session 7, R2, H200, mid-size V4.1 shapes, CUDA graphs, cold weights; us at 8 / 64 rows, GEMM library in
brackets): wo_b 2048 x 2048 6.7 / 7.3 (6.5 / 6.6), stacked wq_a + wkv 1280 x 2048 6.6 / 7.1 (6.7 / 6.5), shared w2
4.9 / 5.0 (5.2 / 5.3): the same as the library, both ~5 us over the bytes (the walk over K is a chain of dependent
loads; a split over K is the next thing to try). Variants measured and dropped: RoPE of the input inside the
product (attention output + `wo_a`: 35 / 129 us against 14 / 15 for rope + bmm + copy) and RMSNorm + RoPE of the
output (q_norm + `wq_b` + rope: 23 / 31 us against 13 / 14): the rotation's extra loads and the per-program
prologue cost more than the launches they saved.
Cost: G*N*K weight elements read once per BM rows (T <= BM: once), x read G*N/BN times, T*G*N written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import INTERPRETING, check, empty, use_triton


def skinny_linear_torch(x: torch.Tensor, w: torch.Tensor, groups: int = 1, glu: tuple | None = None) -> torch.Tensor:
    """The twin (and the CPU path): the grouped product (G = 1: F.linear), [clamped SwiGLU with the up product]."""
    T = x.shape[0]
    if groups == 1:
        y = torch.nn.functional.linear(x, w)
    else:
        g = x.reshape(T, groups, -1)
        y = torch.einsum("tgi,goi->tgo", g, w.view(groups, -1, g.shape[-1])).reshape(T, -1)
    if glu is not None:      # V4's clamped SwiGLU (engine/moe.py swiglu_clamped): gate clamped above, up both sides
        up, limit = torch.nn.functional.linear(x, glu[0]), glu[1]
        y = torch.nn.functional.silu(y.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    return y


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, w3_ptr, limit, T, N, K, x_stride, GLU: tl.constexpr,
                   UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pn = tl.program_id(0)
    g = tl.program_id(1)
    pm = tl.program_id(2)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rok = rows < T
    nok = cols < N
    xrow = x_ptr + rows[:, None].to(tl.int64) * x_stride
    wrow = (g * N + cols).to(tl.int64) * K
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kok = k < K
        x = tl.load(xrow + (g * K + k)[None, :], mask=rok[:, None] & kok[None, :], other=0.0)
        w = tl.load(w_ptr + wrow[None, :] + k[:, None], mask=kok[:, None] & nok[None, :], other=0.0)   # [BK, BN]
        if UPCAST:   # (the interpreter's low-precision dot is wrong: backend.INTERPRETING)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(x, w)
        if GLU:      # the up product over the same x tile
            w3 = tl.load(w3_ptr + wrow[None, :] + k[:, None], mask=kok[:, None] & nok[None, :], other=0.0)
            if UPCAST:
                up += tl.dot(x.to(tl.float32), w3.to(tl.float32))
            else:
                up += tl.dot(x, w3)
    if GLU:          # silu(min(gate, L)) * clamp(up, -L, L), each step rounded as the separate launches stored it
        dt = out_ptr.dtype.element_ty
        gate = tl.minimum(acc.to(dt).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(up.to(dt).to(tl.float32), -limit), limit)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * u
    out = out_ptr + rows[:, None].to(tl.int64) * (N * tl.num_programs(1)) + (g * N + cols)[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rok[:, None] & nok[None, :])


def launch_config(T: int, N: int, K: int, groups: int, elsize: int = 2) -> dict:
    """Block sizes: all rows in one tile up to 64 (the weight is read once); BN about the row count (each program
    reads its rows' x once: x traffic / weight traffic = T / BN), made smaller while the grid would not cover the
    132 SMs of an H200; BK a few KB of weight per stage, 4 stages of x + w tiles within ~128 KB of shared memory."""
    BM = 16 if T <= 16 else 32 if T <= 32 else 64
    BN = min(64, max(16, triton.next_power_of_2(T)))
    while BN > 16 and groups * triton.cdiv(N, BN) < 132:
        BN //= 2
    BK = min(256, max(16, triton.next_power_of_2(K)))
    while BK > 16 and 4 * (BM + BN) * BK * elsize > 128 * 1024:
        BK //= 2
    return dict(BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=4)


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, groups: int = 1, glu: tuple | None = None,
                         config: dict | None = None) -> torch.Tensor:
    """The kernel: same contract as `skinny_linear_torch`. config: launch_config's keys (benchmarks sweep it)."""
    check(x.dim() == 2 and w.dim() == 2, f"skinny_linear: x {tuple(x.shape)} and w {tuple(w.shape)} must be 2-d")
    T, GK = x.shape
    check(GK % groups == 0 and w.shape[0] % groups == 0 and w.shape[1] == GK // groups,
          f"skinny_linear: x {tuple(x.shape)} with w {tuple(w.shape)} in {groups} groups")
    check(x.dtype == w.dtype, f"skinny_linear: x {x.dtype} with w {w.dtype}")
    if glu is not None:
        check(groups == 1 and glu[0].shape == w.shape and glu[0].dtype == w.dtype,
              f"skinny_linear: glu up weight {glu[0].dtype} {tuple(glu[0].shape)} for w {w.dtype} {tuple(w.shape)} "
              f"(want the same shape and dtype, one group)")
    K, N = GK // groups, w.shape[0] // groups
    xs = x if x.stride(1) == 1 else x.contiguous()
    wc = w.contiguous()
    out = empty((T, groups * N), x.dtype, x.device)
    if T == 0 or N == 0:
        return out
    cfg = dict(launch_config(T, N, K, groups, x.element_size()), **(config or {}))
    grid = (triton.cdiv(N, cfg["BN"]), groups, triton.cdiv(T, cfg["BM"]))
    _skinny_kernel[grid](xs, wc, out, glu[0].contiguous() if glu is not None else wc,
                         float(glu[1]) if glu is not None else 0.0, T, N, K, xs.stride(0), GLU=glu is not None,
                         UPCAST=INTERPRETING, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"],
                         num_stages=cfg["num_stages"])
    return out


# rows up to which the kernel runs on CUDA (above it the GEMM library's tiles win: the weight is re-read per 64 rows)
MAX_ROWS = 64


def skinny_linear(x: torch.Tensor, w: torch.Tensor, groups: int = 1, glu: tuple | None = None) -> torch.Tensor:
    """Dispatch: the kernel on CUDA for up to MAX_ROWS rows of a 16-bit dtype, the twin elsewhere."""
    if use_triton(x) and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        return skinny_linear_triton(x, w, groups, glu)
    return skinny_linear_torch(x, w, groups, glu)
