"""Manifold-constrained hyper-connection mixes (V4.1 mHC, architecture doc section 2.2), fused.

From the M residual streams R [T, M, H] of each token and a sub-layer's parameters fn [(2+M)*M, M*H],
base [(2+M)*M], scale [3] (all fp32; the RMSNorm weight is already folded into fn's columns):
  r    = flatten(R) in fp32;  z = (r @ fn^T) * rsqrt(mean(r^2) + norm_eps)
  pre  = sigmoid(z[:M] * scale[0] + base[:M]) + hc_eps                       [T, M]
  post = sigmoid(z[M:2M] * scale[1] + base[M:2M]) * post_mult                [T, M]
  C    = softmax_rows(z[2M:] * scale[2] + base[2M:] as [M, M]) + hc_eps, then a column normalisation,
         then (iters - 1) x (row normalisation, column normalisation); each divides by (sum + hc_eps)   [T, M, M]
C[j, k] mixes source stream j into destination stream k.

Triton, one launch (_hc_fused_kernel): programs (token block, split of the M*H columns) each read their tile
of R once and store a partial z with the sum of squares in its padding column; the last programs of a token
block to start then wait for the block's partials and mix its tokens, one or a few each: every split's partial
of a token loaded at once and added in a fixed order (deterministic), sigmoids, and the softmax + 20 Sinkhorn
steps inside one thread per token (M = 4; no cross-lane sums), the tokens in parallel programs.
Cost: T*M*H*bytes(R) + |fn| (fp32 fn, or its 6-byte bf16 parts from 64 tokens; L2 hits after the first token
block) + the partials (T*n_split*32*4 B, written and read back through L2). H200 (session 7): 10.9 / 16.4 / 89.6
us at T = 64 / 256 / 4096 against 2.9 / 4.6 / 38.4 for one launch that only streams the same bytes; at T=64 the
streaming pass alone takes 6.4 us and the 20 Sinkhorn steps 1.8 (_fused_tiles has the sweep).
The write-back of a sub-layer and the mixes of the NEXT one in one launch (_hc_post_mix_kernel, M = 4): programs
(token block, split of the hidden columns) form R' = post y + comb^T R from R and y, store it and the next
read-out x, and add R' times fn's columns to their partial z (R' in R's dtype: what a separate mixes launch would
read); the same tickets and tail then mix the tokens. It saves the mixes launch and its read of R'.
Both write-back kernels take the sub-layer output as two addends (y2: the MoE's shared expert output beside its
routed one, summed with y in fp32, so no add launch and one rounding), and the write-back + mixes kernel can
RMSNorm the read-out in place (x_norm: the next sub-layer's input norm, so no norm launch): each program stores
its rows' partial sums of squares of x as rounded; once a token block's partials are in, every program
normalises its own columns (norm form 2: the grid resident at once), or else the waiters whole rows (form 1:
26.6 / 41.2 us at T = 8 / 64 on the H200, slower than a separate norm launch). At H = 5120 and T = 64 the grid is
160 programs of 4 warps, resident at once on GPUs of 80 SMs or more; on a smaller GPU hc_post_mix_apply never
takes form 1 (it keeps the write-back + mixes launch up to 16 tokens, or two launches, and norms after them), so
form 1 runs only where hc_post_mix_triton is asked for the norm directly (and in the interpreter).
The product r . fn^T needs fp32 accuracy: bf16 residuals (the model's) take three bf16 tensor-core products
against a hi/mid/lo bf16 split of fn (exact products, fp32 accumulation); fp32 residuals use Triton's "ieee" dot
(FMAs: D measured it arithmetic-bound, 1-3% of bandwidth on an H200).
Programmatic dependent launch (session 12): every launch here waits first (R, y, the mixes and the ticket counters
are the step's) and none lets the next kernel launch early (the mixing kernels' programs spin on each other, so
the next kernel's programs must not take the slots their not-yet-started ones need). H200 session 12 R3
(benchmarks/kernels_moe.py's pdl sweep; mid-size H = 2048, 16 calls back to back in a CUDA graph; us, off -> on):
the MoE write-back + mixes + norm T=64 11.02 / 11.01 -> 10.76 / 10.82, the write-back + read-out T=256 4.86 /
4.87 -> 4.73 / 4.73, the mixes T=256 11.77 / 11.77 -> 11.54 / 11.54.
Session 13 (the mid-size model's hidden 2048): the write-back + mixes launch takes tiles that fill the GPU once
(_post_mix_tiles: 16- to 128-wide splits instead of 64 / 128; at T=64 its 64 programs left half the SMs idle: ncu,
11.2K of 28.1K cycles active, 6% achieved occupancy), the read-out norm inside wherever the grid is resident at
once (up to 256 tokens at H = 2048; 96 at 5120: session 13, MoE / attention write-back at T = 80 15.9 /
15.6 us, T = 96 17.0 / 16.7, against 21.3 / 18.7 and 21.8 / 19.0 for the write-back + norm launches) and fn's
bf16 parts from 32 tokens (parts_pay). H200 R3
(HEAD's module imported beside this one, 16 calls back to back in a CUDA graph, PDL on; us a call, HEAD -> this;
R, R', y, y2, x and fp32 fn once take 0.27 / 0.86 / 2.90 us at 4250 GB/s at T = 8 / 64 / 256: 4 / 10 / 17% of
this): the MoE write-back + norm + mixes at T = 8 / 16 / 32 / 64 / 128 / 256 7.95 / 8.06-8.08 / 12.41 / 10.78-10.80
/ 14.46-14.48 / 18.65 -> 7.13-7.16 / 7.20 / 7.21 / 8.27 / 12.15 / 17.38-17.40 (T = 128 / 256: one launch instead
of three); the attention one at T = 64 10.84-10.87 -> 8.20-8.23 (R2, T = 256: 18.75 -> 17.44); V4.1's H = 5120 at
T = 32 / 64 12.51 / 14.81 -> 11.77 / 14.80 (T = 32: the parts). Where the time goes at T=64: the streaming pass
alone 4.0 of 8.3 us (R1); the 20-step Sinkhorn 1.2 (one step: 7.05, R3); the rest of the tail (the wait for the
block's partials, their loads through L2, the norm) ~3.
Session 14: the mixes feed only the write-back after the next sub-layer, so hc_post_mix_triton(defer=True) ends
the launch once R', x and x's norm are stored and leaves the partials' reduction and the Sinkhorn to a launch of
their own (_mix_partials_kernel), which engine/mhc.py runs on a side stream beside that sub-layer, up to
DEFER_MAX_T tokens (its numbers). R1 (H200, H = 2048, T = 64, the MoE write-back then the stacked wq_a + wkv
product, 16 calls in a CUDA graph): 20 Sinkhorn steps 15.93 us a call, 1 step 14.42.
Session 15: why deferring lost from 32 tokens. The finish ran a program a token (the waiters' shape), so T programs
of 4 warps took SMs just as the sub-layer's first product started, and that product waited for them. A torch.profiler
timeline of the chain (two write-backs + mixes + norm, four 2048 x 2048 GEMM-library products after each; H200 R1,
T = 64, one CUDA-graph replay): tail inside, write-backs 8.74 / 8.32 us, products 5.0-5.3, 59.4 us in all;
deferred, write-backs 6.72 / 6.43 (the tail's 2 us off them), finishes 4.06 / 4.35 on the side stream, but the
product after each write-back 8.10 / 8.16 (the others 5.1), 62.0 us; the finish with 16 tokens a program (4
programs, 7.5-8.2 us), no product stretched, 56.5 us. The side stream at high priority changed nothing (66.7 us a
chain against 63.4-66.8), the finish on the main stream (no overlap) 62.9-63.9. So the finish mixes 16 tokens a
program (_finish_tokens), its partials' sums then in another order than the waiters' (the mixes within fp32
rounding of the tail-inside ones; the same bits where the waiters mixed 16 tokens each, grids not resident).
Measured and deleted (R2): the 16 tokens' partials added token by token in the waiters' shape, to keep their bits
(the loop of 16 [1, SPC, NZP] sums): 50 us a finish, longer than the sub-layer beside it (a chain 163-201 us
against 57-91), and still not the waiters' bits on the GPU.
Session 16, measured and deleted (K4 R2, H200, the MoE write-back with y2 and the read-out norm at H = 2048, 64
input sets rotating so fn comes cold as in a step, 64 calls in a CUDA graph, us a call, off / on twice): each
write-back program asking L1 for its fn columns of all four streams before the PDL wait (prefetch.global.L1, four
hints a thread; the stream loop's fn loads, one stream after another, would then hit L1): deferred T = 8
5.98-6.00 / 7.70-8.00, T = 64 7.69-7.70 / 7.90-7.93; T = 256 (tail inside) 17.66-17.77 / 22.05-22.08. At T = 64
the launch moves ~4.1 MB (R, R', y, y2, x and fn's 1.2 MB of bf16 parts): ~1.0 us at copy bandwidth, 12% of the
7.7 us; at T = 8 ~1.2 MB (fp32 fn) against 6.0 us: both latency chains (the wait, the loads, four streams' fn
tiles and products in turn, the stores, the read-out norm's wait for its token block's partial sums).
"""
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import INTERPRETING, check, empty, one_wave, pdl_kw, pdl_wait, sm_count, tickets, use_triton
from .rmsnorm import rms_norm, rms_norm_torch

_CAN_RCP = not INTERPRETING      # hardware reciprocals (rcp.approx) need compiled kernels
_PTX = tl.constexpr(not INTERPRETING)     # inline PTX runs in compiled kernels only


@dataclass
class HcMixes:
    pre: torch.Tensor    # fp32 [T, M]: read-out weights for the next sub-layer's input
    post: torch.Tensor   # fp32 [T, M]: write-back weights of this sub-layer's output
    comb: torch.Tensor   # fp32 [T, M, M]: stream mixing, C[t, j, k] = source j -> destination k
    # hc_post_mix_triton(defer=True): the launch that fills the three (the caller runs it, e.g. on a side stream,
    # and keeps this object until that work is joined); None: they are filled already
    finish: object = None


def _check(residual, fn, base, scale):
    check(residual.dim() == 3, f"residual must be [tokens, streams, hidden], got {tuple(residual.shape)}")
    T, M, H = residual.shape
    nz = (2 + M) * M
    check(fn.shape == (nz, M * H), f"hc fn must be [{nz}, {M * H}] for {M} streams of {H}, got {tuple(fn.shape)}")
    check(base.shape == (nz,), f"hc base must be [{nz}], got {tuple(base.shape)}")
    check(scale.shape == (3,), f"hc scale must be [3], got {tuple(scale.shape)}")


# ---------------------------------------------------------------------------------------------- torch twin
def hc_mixes_torch(residual, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20, post_mult=2.0) -> HcMixes:
    _check(residual, fn, base, scale)
    T, M, H = residual.shape
    r = residual.reshape(T, M * H).float()
    z = (r @ fn.float().t()) * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(z[:, :M] * scale[0] + base[:M]) + hc_eps
    post = torch.sigmoid(z[:, M:2 * M] * scale[1] + base[M:2 * M]) * post_mult
    c = (z[:, 2 * M:] * scale[2] + base[2 * M:]).view(T, M, M)
    c = torch.softmax(c, -1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return HcMixes(pre, post, c)


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _rcp(x, FAST: tl.constexpr):
    """1 / x; FAST: the hardware reciprocal (rcp.approx, within 1 ulp: one instruction instead of the ~6 of a
    rounded division; the interpreter cannot run PTX, so it divides)."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 / x


@triton.jit
def _softmax4(a, b, c, d, eps, FAST: tl.constexpr):
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    s = _rcp((a + b) + (c + d), FAST)
    return a * s + eps, b * s + eps, c * s + eps, d * s + eps


@triton.jit
def _norm4(a, b, c, d, eps, FAST: tl.constexpr):
    s = _rcp((a + b) + (c + d) + eps, FAST)     # a tree: a shorter serial chain
    return a * s, b * s, c * s, d * s


@triton.jit
def _load4(p, ok):
    return (tl.load(p, mask=ok, other=0.0), tl.load(p + 1, mask=ok, other=0.0), tl.load(p + 2, mask=ok, other=0.0),
            tl.load(p + 3, mask=ok, other=0.0))


@triton.jit
def _store4(p, a, b, c, d, ok):
    tl.store(p, a, mask=ok)
    tl.store(p + 1, b, mask=ok)
    tl.store(p + 2, c, mask=ok)
    tl.store(p + 3, d, mask=ok)


@triton.jit
def _sinkhorn4(c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, hc_eps,
               ITERS: tl.constexpr, FAST: tl.constexpr):
    """M = 4: a token's 16 comb logits as 16 tensors (one value per token), so its whole softmax + Sinkhorn runs
    inside one thread with explicit sums: no cross-lane traffic in the 2 * ITERS serial steps (a [BT, 4, 4] block
    spends shuffles on every step; [BT, 4] row tensors too, unless BT * 4 exceeds the program's threads). Same
    arithmetic as the twin up to the reciprocal (one per row / column, then products)."""
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, hc_eps, FAST)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, hc_eps, FAST)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, hc_eps, FAST)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, hc_eps, FAST)
    for it in range(ITERS):       # a column step, then a row step except after the last column one (a loop, not
        # unrolled: measured this way; unrolled inside the deleted one-launch kernel, the build took 23 s, not 3)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps, FAST)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps, FAST)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps, FAST)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps, FAST)
        if it < ITERS - 1:
            c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, hc_eps, FAST)
            c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, hc_eps, FAST)
            c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, hc_eps, FAST)
            c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, hc_eps, FAST)
    return c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33


@triton.jit
def _sinkhorn4_reload(comb_ptr, toks, tok_ok, hc_eps, ITERS: tl.constexpr, FAST: tl.constexpr):
    """_sinkhorn4 on the logits just written to comb (reloaded per token: other threads stored them)."""
    o = comb_ptr + toks * 16
    c00, c01, c02, c03 = _load4(o, tok_ok)
    c10, c11, c12, c13 = _load4(o + 4, tok_ok)
    c20, c21, c22, c23 = _load4(o + 8, tok_ok)
    c30, c31, c32, c33 = _load4(o + 12, tok_ok)
    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 = _sinkhorn4(
        c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, hc_eps, ITERS, FAST)
    _store4(o, c00, c01, c02, c03, tok_ok)
    _store4(o + 4, c10, c11, c12, c13, tok_ok)
    _store4(o + 8, c20, c21, c22, c23, tok_ok)
    _store4(o + 12, c30, c31, c32, c33, tok_ok)


@triton.jit
def _col(x, n, i):
    """Column i of x [tokens, NZP] (n: the column indices) as one value per token (a sum across lanes)."""
    return tl.sum(tl.where(n[None, :] == i, x, 0.0), 1)


@triton.jit
def _sinkhorn4_regs(x, n, comb_ptr, toks, tok_ok, hc_eps, ITERS: tl.constexpr, FAST: tl.constexpr):
    """_sinkhorn4 on the comb logits (columns 8..23 of x [tokens, NZP]) taken out of x in registers: 16 lane sums
    instead of a store, a barrier and a reload through L2."""
    c00, c01, c02, c03 = _col(x, n, 8), _col(x, n, 9), _col(x, n, 10), _col(x, n, 11)
    c10, c11, c12, c13 = _col(x, n, 12), _col(x, n, 13), _col(x, n, 14), _col(x, n, 15)
    c20, c21, c22, c23 = _col(x, n, 16), _col(x, n, 17), _col(x, n, 18), _col(x, n, 19)
    c30, c31, c32, c33 = _col(x, n, 20), _col(x, n, 21), _col(x, n, 22), _col(x, n, 23)
    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 = _sinkhorn4(
        c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, hc_eps, ITERS, FAST)
    o = comb_ptr + toks * 16
    _store4(o, c00, c01, c02, c03, tok_ok)
    _store4(o + 4, c10, c11, c12, c13, tok_ok)
    _store4(o + 8, c20, c21, c22, c23, tok_ok)
    _store4(o + 12, c30, c31, c32, c33, tok_ok)


@triton.jit
def _sinkhorn_block(comb_ptr, toks, tok_ok, hc_eps, M: tl.constexpr, ITERS: tl.constexpr, FAST: tl.constexpr):
    """Any power-of-two M: the logits reloaded as one [BT, M, M] block (sums across lanes)."""
    j = tl.arange(0, M)
    o = comb_ptr + toks[:, None, None] * (M * M) + j[None, :, None] * M + j[None, None, :]
    c = tl.load(o, mask=tok_ok[:, None, None], other=0.0)
    c = tl.exp(c - tl.max(c, 2)[:, :, None])
    c = c * _rcp(tl.sum(c, 2), FAST)[:, :, None] + hc_eps
    c = c * _rcp(tl.sum(c, 1) + hc_eps, FAST)[:, None, :]
    for _ in tl.static_range(ITERS - 1):
        c = c * _rcp(tl.sum(c, 2) + hc_eps, FAST)[:, :, None]
        c = c * _rcp(tl.sum(c, 1) + hc_eps, FAST)[:, None, :]
    tl.store(o, c, mask=tok_ok[:, None, None])


@triton.jit
def _mix_rows(acc, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, K, NZ, norm_eps, hc_eps, post_mult, toks, tok_ok,
              M: tl.constexpr, NZP: tl.constexpr, ITERS: tl.constexpr, FAST: tl.constexpr, REG: tl.constexpr):
    """The summed z rows acc [tokens, NZP] (sum of squares in column NZ) of the tokens `toks` -> pre, post and the
    Sinkhorn-projected comb: sigmoids on the whole block; for the Sinkhorn loop the comb logits either go to the
    output and come back per token (a CTA barrier between: other threads of this program stored them) or, with
    REG (M = 4), are taken out of the block in registers."""
    n = tl.arange(0, NZP)
    sq = tl.sum(tl.where(n[None, :] == NZ, acc, 0.0), 1)
    inv_rms = 1.0 / tl.sqrt(sq / K + norm_eps)
    scale = tl.where(n < M, tl.load(scale_ptr), tl.where(n < 2 * M, tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)))
    x = acc * inv_rms[:, None] * scale[None, :] + tl.load(base_ptr + n, mask=n < NZ, other=0.0)[None, :]
    sig = tl.sigmoid(x)
    row = toks[:, None]
    col = n[None, :]
    tl.store(pre_ptr + row * M + col, sig + hc_eps, mask=tok_ok[:, None] & (col < M))
    tl.store(post_ptr + row * M + (col - M), sig * post_mult, mask=tok_ok[:, None] & (col >= M) & (col < 2 * M))
    if M == 4 and REG:
        _sinkhorn4_regs(x, n, comb_ptr, toks, tok_ok, hc_eps, ITERS, FAST)
    else:
        tl.store(comb_ptr + row * (M * M) + (col - 2 * M), x, mask=tok_ok[:, None] & (col >= 2 * M) & (col < NZ))
        tl.debug_barrier()              # the logits other threads stored are read back below
        if M == 4:
            _sinkhorn4_reload(comb_ptr, toks, tok_ok, hc_eps, ITERS, FAST)
        else:
            _sinkhorn_block(comb_ptr, toks, tok_ok, hc_eps, M, ITERS, FAST)


@triton.jit
def _fn_tiles(fn_ptr, K, NZ, zs, cols, ok, MODE: tl.constexpr):
    """fn's tiles [NZP, BK] at the columns `cols` (masked by ok [BK]): (fp32 fn, same, same) for modes 0-1, the
    three bf16 parts (hi, mid, lo) of fn given as [3, NZ, K] for mode 2."""
    wm = (zs[:, None] < NZ) & ok[None, :]
    w = fn_ptr + zs[:, None] * K + cols[None, :]
    if MODE == 2:
        return tl.load(w, mask=wm, other=0.0), tl.load(w + NZ * K, mask=wm, other=0.0), \
            tl.load(w + 2 * NZ * K, mask=wm, other=0.0)
    else:
        a = tl.load(w, mask=wm, other=0.0)
        return a, a, a


@triton.jit
def _load_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, k0, live, BK: tl.constexpr, MODE: tl.constexpr):
    """r [BT, BK] at columns k0.. and fn's tiles there (_fn_tiles); nothing is loaded where `live` is False."""
    ks = k0 + tl.arange(0, BK)
    ok = (ks < K) & live
    r = tl.load(r_ptr + toks[:, None].to(tl.int64) * K + ks[None, :], mask=(toks[:, None] < T) & ok[None, :],
                other=0.0)
    a, b, c = _fn_tiles(fn_ptr, K, NZ, zs, ks, ok, MODE)
    return r, a, b, c


@triton.jit
def _add_products(acc, r, a, b, c, MODE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + r . fn^T over one step, a, b, c from _load_tiles. MODE 0: one fp32 dot (PRECISION) against fp32 fn.
    MODE 1: fp32 fn split in registers into hi + mid + lo bf16 parts (== fn to ~2**-24): three bf16 tensor-core
    products, exact in fp32 accumulation. MODE 2: the same with the parts read (6 bytes a weight). UPCAST: the
    interpreter computes bf16 dots wrongly, so it takes them in fp32 (same exact products)."""
    if MODE == 0:                       # (no early return: the sm_90 build compiles the code after it too)
        acc += tl.dot(r.to(tl.float32), tl.trans(a), input_precision=PRECISION)
    else:
        if MODE == 1:                   # fn's hi / mid / lo bf16 parts, made from the fp32 tile
            hi = a.to(tl.bfloat16)
            rest = a - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        else:
            hi, mid, lo = a, b, c
        if UPCAST:                      # the interpreter: the same exact products in fp32
            rf = r.to(tl.float32)
            acc += tl.dot(rf, tl.trans(hi.to(tl.float32)), input_precision="ieee")
            acc += tl.dot(rf, tl.trans(mid.to(tl.float32)), input_precision="ieee")
            acc += tl.dot(rf, tl.trans(lo.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(r, tl.trans(hi))
            acc += tl.dot(r, tl.trans(mid))
            acc += tl.dot(r, tl.trans(lo))
    return acc


@triton.jit
def _load_acquire(p, PTX: tl.constexpr):
    """The int32 at p, read with acquire semantics (gpu scope): a plain load in the PTX form (ld.acquire; no
    read-modify-write at the L2 for the counter the other programs are adding to), an atomic add of 0 in the
    interpreter."""
    if PTX:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p.to(tl.int64, bitcast=True)],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_add(p, 0, sem="acquire", scope="gpu")


@triton.jit
def _leave(start_ptr, last, PTX: tl.constexpr):
    """A waiter's leaving ticket on its token block's start counter (start_ptr; the store counter follows it):
    the last waiter out (the counter at `last` before its add) puts both back to 0. PTX: thread 0 alone does it in
    one asm block that nothing waits for (Triton's scalar atomics broadcast the result through shared memory
    behind a CTA barrier, so every thread would wait for the round trip); the interpreter: Triton's atomics."""
    if PTX:
        tl.inline_asm_elementwise("""{
        .reg .pred p, q;
        .reg .u32 t, o;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        setp.ne.u32 q, t, t;
        @p atom.global.gpu.relaxed.add.u32 o, [$1], 1;
        @p setp.eq.u32 q, o, $2;
        @q st.relaxed.gpu.global.b32 [$1], 0;
        @q st.relaxed.gpu.global.b32 [$1+4], 0;
        mov.u32 $0, 0;
        }""", "=r,l,r", [start_ptr.to(tl.int64, bitcast=True), last], dtype=tl.int32, is_pure=False, pack=1)
    else:
        if tl.atomic_add(start_ptr, 1, sem="relaxed", scope="gpu") == last:
            tl.atomic_xchg(start_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(start_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _norm_rows(x_ptr, w_ptr, xsq_ptr, toks, ok, c0, c1, H, n_split, eps, BK: tl.constexpr, NSP: tl.constexpr):
    """RMSNorm in place of the read-out rows `toks` (x [T, H], x's dtype, as stored) over the columns c0 .. c1:
    each row's sum of squares from its n_split partials in xsq [T, n_split] (added in one fixed order), then
    x * rsqrt(mean + eps) * w (fp32 w [H]) rounded once to x's dtype, as kernels/rmsnorm.py computes it."""
    s = tl.arange(0, NSP)
    q = tl.load(xsq_ptr + toks[:, None].to(tl.int64) * n_split + s[None, :], mask=ok[:, None] & (s[None, :] < n_split),
                other=0.0, cache_modifier=".cg")
    r = 1.0 / tl.sqrt(tl.sum(q, 1) / H + eps)
    row = toks[:, None].to(tl.int64) * H
    for c in range(c0, c1, BK):
        h = c + tl.arange(0, BK)
        hm = (h < c1) & (h < H)
        m = ok[:, None] & hm[None, :]
        x = tl.load(x_ptr + row + h[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(w_ptr + h, mask=hm, other=0.0)
        tl.store(x_ptr + row + h[None, :], (x * r[:, None] * w[None, :]).to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def _wait_stores(p, n, FORM: tl.constexpr):
    """Wait until the store counter at p reaches n (acquire), then a CTA barrier."""
    done = _load_acquire(p, (FORM & 4) != 0)
    while done < n:
        done = _load_acquire(p, (FORM & 4) != 0)
    tl.debug_barrier()


@triton.jit
def _partials(z_ptr, mt, ok, s0, n_split, NZ, NZP: tl.constexpr, SPC: tl.constexpr):
    """Splits s0 .. s0 + SPC of the tokens mt's partial z rows (z [T, n_split, NZP]; ok: the tokens' mask) ->
    [tokens, SPC, NZP], through L2 (other programs stored them)."""
    s = s0 + tl.arange(0, SPC)
    n = tl.arange(0, NZP)
    return tl.load(z_ptr + ((mt[:, None, None].to(tl.int64) * n_split + s[None, :, None]) * NZP + n[None, None, :]),
                   mask=ok[:, None, None] & (s[None, :, None] < n_split) & (n[None, None, :] <= NZ), other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _finish_block(acc, sq, ticket, z_ptr, cnt_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NZ, n_split,
                  norm_eps, hc_eps, post_mult, tb, sp, toks, x_ptr, w_ptr, xsq_ptr, H, x_eps, c0, c1,
                  M: tl.constexpr, NZP: tl.constexpr, BT: tl.constexpr, NW: tl.constexpr, TPW: tl.constexpr,
                  SPC: tl.constexpr, ITERS: tl.constexpr, FAST: tl.constexpr, TAIL: tl.constexpr, FORM: tl.constexpr,
                  NORM: tl.constexpr, BKN: tl.constexpr, NSP: tl.constexpr):
    """A program's partial z acc [BT, NZP] of the tokens `toks` (sq: their sums of squares, put in column NZ)
    stored as split sp of z [T, n_split, NZP]; then, with TAIL, the store counted and, for the last NW starters
    of token block tb (ticket: this program's start ticket), the wait for the block's partials and the mixing of
    TPW tokens each (module docstring; _hc_fused_kernel says why it cannot deadlock).
    FORM (bits, the tail's form): 1: a waiter takes its leaving ticket (the last one out resets the counters) as
    soon as its partials' loads are issued, one thread in PTX that nothing waits for (_leave), instead of after
    the mixing through a scalar atomic that ends the kernel with a CTA-wide wait for its round trip; 2: the
    Sinkhorn loop's logits taken out in registers (_mix_rows REG); 4: the wait polls with acquire loads, not
    atomic adds (compiled kernels only: _tail_form clears it for the interpreter).
    NORM (the write-back's read-out x [T, H] normalised in place, _norm_rows, its sums of squares' partials already
    in xsq): 1: the waiters, after the wait, each its tokens' whole rows (from memory); 2 (the grid resident at
    once): every program waits for the block's stores, so every program takes a leaving ticket, and the
    non-waiters normalise the block's tokens in every program's columns (blocks of c1 - c0, dealt by start
    ticket), the waiters none (or, when every program is a waiter, each its own columns while its partials'
    loads are in flight). H200 session 10 round 2 (us, H = 5120, T = 8 / 16 / 32 / 64, the MoE write-back with
    y2): 9.3 / 10.0 / 13.8 / 15.2; every program its own columns (the waiters beside their partials' loads)
    10.1 / 10.6 / 15.4 / 16.1 (deleted); round 1, form 1 at T = 8 / 64 26.6 / 41.2 (a waiter's rows in turn)."""
    zs = tl.arange(0, NZP)
    acc = tl.where(zs[None, :] == NZ, sq[:, None], acc)
    tl.store(z_ptr + (toks[:, None].to(tl.int64) * n_split + sp) * NZP + zs[None, :], acc,
             mask=(toks[:, None] < T) & (zs[None, :] <= NZ))
    if TAIL:
        tl.debug_barrier()              # every thread's partial stores precede the release below
        tl.atomic_add(cnt_ptr + 2 * tb + 1, 1, sem="release", scope="gpu")
        w = ticket - (n_split - NW)
        last = n_split + NW - 1         # the start counter's value before the last leaving ticket
        if NORM == 2:
            last = 2 * n_split - 1
            _wait_stores(cnt_ptr + 2 * tb + 1, n_split, FORM)
            if w < 0:
                _leave(cnt_ptr + 2 * tb, last, _PTX)
                for c in range(ticket, n_split, n_split - NW):      # every program's columns, dealt by ticket
                    _norm_rows(x_ptr, w_ptr, xsq_ptr, toks, toks < T, c * (c1 - c0), (c + 1) * (c1 - c0), H,
                               n_split, x_eps, BKN, NSP)
        if w >= 0:
            if NORM != 2:
                _wait_stores(cnt_ptr + 2 * tb + 1, n_split, FORM)
            j = w + tl.arange(0, TPW) * NW                  # this waiter's tokens in the block
            mt = tb * BT + j
            ok = (j < BT) & (mt < T)
            z = tl.zeros([TPW, NZP], tl.float32)
            for s0 in range(0, n_split, SPC):
                v = _partials(z_ptr, mt, ok, s0, n_split, NZ, NZP, SPC)
                if s0 == 0:
                    if FORM & 1:        # leave now: the round trip overlaps the partials' loads just issued
                        _leave(cnt_ptr + 2 * tb, last, _PTX)
                    if NORM == 2 and NW == n_split:     # no non-waiters: its own columns, beside the partials' loads
                        _norm_rows(x_ptr, w_ptr, xsq_ptr, toks, toks < T, c0, c1, H, n_split, x_eps, BKN, NSP)
                z += tl.sum(v, 1)
            _mix_rows(z, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, K, NZ, norm_eps, hc_eps, post_mult, mt,
                      ok, M, NZP, ITERS, FAST, (FORM & 2) != 0)
            if not FORM & 1:
                _leave(cnt_ptr + 2 * tb, last, False)
            if NORM == 1:
                _norm_rows(x_ptr, w_ptr, xsq_ptr, mt, ok, 0, H, H, n_split, x_eps, BKN, NSP)


@triton.jit
def _hc_fused_kernel(r_ptr, fn_ptr, z_ptr, cnt_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NZ,
                     n_split, norm_eps, hc_eps, post_mult, M: tl.constexpr, NZP: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, NW: tl.constexpr, TPW: tl.constexpr, SPC: tl.constexpr,
                     ITERS: tl.constexpr, FAST: tl.constexpr, TAIL: tl.constexpr, PF: tl.constexpr,
                     FORM: tl.constexpr, PDL: tl.constexpr = False):
    """One launch. Program (token block tb, split sp of the M*H columns): partial z of its BT tokens over its
    columns (sum of squares in column NZ), stored token-major in z [T, n_split, NZP]. The LAST NW programs of a
    token block to START (a ticket taken after the first tiles' loads are issued) then wait until all n_split
    partials of the block are stored, and each mixes TPW of its tokens: all splits' partials of a token loaded at
    once and added by a fixed tree (deterministic), sigmoids, a per-thread Sinkhorn per token. Waiting only in
    the last starters cannot deadlock: every other program of the block has started and waits for nothing.
    The counters cnt[2 tb] (starts), cnt[2 tb + 1] (stores) are zero on entry and left zero on exit (the last
    waiter resets them). TAIL=False: partials only (benchmark breakdown). PDL: the wait comes first, no early
    trigger (as _hc_post_mix_kernel)."""
    pdl_wait(PDL)
    tb = tl.program_id(0)
    sp = tl.program_id(1)
    toks = tb * BT + tl.arange(0, BT)
    zs = tl.arange(0, NZP)
    acc = tl.zeros([BT, NZP], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    NI: tl.constexpr = SPLIT // BK
    k0 = sp * SPLIT
    r, a, b, c = _load_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, k0, PF, BK, MODE)
    ticket = 0
    if TAIL:                            # issued behind the first loads: its round trip overlaps theirs
        ticket = tl.atomic_add(cnt_ptr + 2 * tb, 1, sem="relaxed", scope="gpu")
    for i in range(0, NI):              # PF: each step's tiles loaded one step ahead
        if PF:
            rc, ac, bc, cc = r, a, b, c
            r, a, b, c = _load_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, k0 + (i + 1) * BK, i + 1 < NI, BK, MODE)
        else:
            rc, ac, bc, cc = _load_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, k0 + i * BK, True, BK, MODE)
        acc = _add_products(acc, rc, ac, bc, cc, MODE, PRECISION, UPCAST)
        rf = rc.to(tl.float32)
        sq += tl.sum(rf * rf, 1)
    _finish_block(acc, sq, ticket, z_ptr, cnt_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NZ,
                  n_split, norm_eps, hc_eps, post_mult, tb, sp, toks, z_ptr, z_ptr, z_ptr, K, norm_eps, 0, 0, M, NZP,
                  BT, NW, TPW, SPC, ITERS, FAST, TAIL, FORM, 0, BK, 1)


def _one_wave(programs: int, warps: int, dev) -> bool:
    """Whether `programs` programs of `warps` warps are all resident at once on dev, whatever their registers:
    a thread holds at most 255 registers, so an SM (64K registers) keeps 8 // warps such programs (at most 2 are
    counted: the kernels' shared memory, <= 74 KB a program at the tiles measured, allows 2 of the 228 KB)."""
    if INTERPRETING or dev.type != "cuda":
        return False
    return programs <= sm_count(dev) * max(1, min(2, 8 // warps))


@dataclass
class _SplitLaunch:
    """Launch shape of a split kernel with a mixing tail (_hc_fused_kernel, _hc_post_mix_kernel)."""
    split: int          # columns a program covers (clamped to the columns there are)
    block_k: int        # columns a loop step covers (<= split)
    n_split: int        # programs per token block
    n_tb: int           # token blocks
    nw: int             # waiters per token block (programs that mix its tokens)
    tpw: int            # tokens each waiter mixes (power of two)
    spc: int            # splits' partials a waiter loads at once per token
    block_t: int        # tokens a program covers
    warps: int          # warps a program
    resident: bool      # whether the whole grid is resident at once (_one_wave)


# One ticket site for every mHC mixing launch: they run in turn on the main stream (kernels.backend.tickets).
TICKET_SITE = "hc_mix"


# The mixing tail's form (_finish_block FORM bits)
# H200 session 9 round 1 (us, form 0 -> 7): mixes T=64 10.9 -> 9.9 (1: 10.5, 3: 10.5), write-back then mixes
# T=64 14.8 -> 13.8; but T=256 16.4 -> 17.0 and T=4096 89.3 -> 93.6, where waiters mix 2 / 128 tokens each (the
# register logits spilled 8 registers in the T=256 build); round 2: form 5 there 17.1 / 89.4 against 16.4 /
# 89.6. So 7 where each waiter mixes one token, else 0. Measured and deleted (round 2): the write-back letting
# the mixes launch start early (programmatic dependent launch, gdc_wait in the mixes kernel): T=64 / 32 15.1 /
# 14.0 against 13.8 / 12.9 for the two plain launches. (Session 12 launches every mHC kernel with PDL, the wait
# first and no early trigger: the module docstring has its numbers.)
def _tail_form(form: int | None, tpw: int) -> int:
    form = (7 if tpw == 1 else 0) if form is None else form
    return form & ~4 if INTERPRETING else form        # (the acquire-load poll is PTX)


def _grid(T: int, K: int, block_t: int, split: int, block_k: int) -> tuple:
    """(split, block_k, n_split, n_tb): the split and step widths clamped to K, and the grid they give."""
    split = min(split, max(block_k, triton.next_power_of_2(K)))
    return split, min(block_k, split), triton.cdiv(K, split), triton.cdiv(T, block_t)


def _partials_at_once(n_split: int, tpw: int) -> int:
    """Splits' partials a program mixing tpw tokens loads at once per token: <= 8192 partial values at once."""
    return min(triton.next_power_of_2(n_split), max(1, 256 // tpw))


def _split_launch(T: int, K: int, block_t: int, split: int, block_k: int, warps: int, waiters, spc, dev):
    """The launch shape for T tokens over K columns (module docstring; its ticket counters are fetched by
    `_counters` when the launch runs, so a shape asked only for its residency takes none). Waiting is safe for the
    last starter of
    a token block (every other program of the block has started and waits for nothing); several waiters wait for
    programs that may not have started, so they are used only while the whole grid is resident at once (spinning
    programs would otherwise hold the slots the missing ones need: seen on the H200 at T=4096, 1280 programs);
    the interpreter runs programs one after another."""
    split, block_k, n_split, n_tb = _grid(T, K, block_t, split, block_k)
    resident = _one_wave(n_tb * n_split, warps, dev)
    nw = min(waiters or block_t, block_t, n_split) if resident else 1
    tpw = triton.next_power_of_2(-(-block_t // nw))
    spc = spc or _partials_at_once(n_split, tpw)
    return _SplitLaunch(split, block_k, n_split, n_tb, nw, tpw, spc, block_t, warps, resident)


def _counters(dev, n_tb: int) -> torch.Tensor:
    """The 2 ticket counters per token block of a mixing launch (kernels.backend.tickets, TICKET_SITE)."""
    cnt = tickets(dev, 2 * n_tb, site=TICKET_SITE)
    check(cnt is not None, f"mHC mixes: no ticket counters for {n_tb} token blocks while a CUDA graph is being "
          "captured; run the step once before capturing it (warm-up)")
    return cnt


def split_fn_bf16(fn: torch.Tensor) -> torch.Tensor:
    """fp32 fn [NZ, K] -> bf16 [3, NZ, K] with hi + mid + lo equal to fn within ~2**-24 relative."""
    f = fn.float()
    hi = f.to(torch.bfloat16)
    rest = f - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo]).contiguous()


# Hardware reciprocals in the Sinkhorn loop (compiled kernels; the interpreter divides).
FAST_RCP_DEFAULT = True
# Measured and deleted: TWO launches (session 2-6: partials per (token block, split) stored, then a mixing launch
# of 2 tokens a program adding 16 splits' partials at a time): H200 session 7 round 2, T = 64 / 256 / 4096:
# 11.3 / 18.0 / 150.2 us against 10.9 / 16.4 / 89.6 for the one launch at its tiles below. Earlier: a wide split
# reduce (15.8-18.5 us at T=64, session 3); the [tokens, 4, 4] block Sinkhorn (two shuffles a step; kept for
# M != 4; 4.6 us mixing launch against 3.5, session 5); a one launch whose LAST program of a token block added
# all partials and mixed every token (session 5: 12.9 us at T=64; here "one waiter": 46.5 us at T=64, its
# partial loads and 64 tokens' Sinkhorn are serial); 8 waiters a block 15.9 us; first-pass tiles through tensor
# descriptors (session 5: 16.4 us first pass against 7.6); the sum of squares on tensor cores (15.3 against 12.5).


def _fused_tiles(T: int) -> dict:
    """The one-launch kernel's tiles at T tokens (H200 session 7 round 2, us; the read floor is one launch that
    only streams the same bytes: 2.9 / 4.6 / 38.4 us):
      T <= 128: 64-token blocks, 256-wide splits, 128-wide steps (80 programs, fn split in registers; parts from
                64 tokens since session 9, parts_pay): T=64
                10.9 (128-wide splits 11.8, 32-token blocks 12.8, 16-token 13.1; first pass alone 6.4)
      T <= 256: 64 x 512 x 128 with fn's cached bf16 parts: 16.4 (fn split in registers 18.7, 128-token blocks
                19.2, 1024-wide splits 22.7)
      larger:   128-token blocks, 2048-wide splits, 64-wide steps, 8 warps, parts, loads pipelined by Triton (3
                stages) instead of a step ahead by hand: T=4096 89.6 (a step ahead 98.1; 64 x 1024 x 128 107.5).
    Session 8 round 1 (registers of the real launches' builds, which specialise the integer arguments: none of
    these spills; --compile-check's unspecialised builds reported 1.0-1.6 KB): T=64 default 11.1 (254 registers),
    64-wide steps 12.4 (127), 8 warps 12.5 (143); T=256 default 16.4 (255), 64-wide steps 16.1 (157)."""
    if T <= 128:
        return dict(block_t=64, split=256, block_k=128, num_warps=4)
    if T <= 256:
        return dict(block_t=64, split=512, block_k=128, num_warps=4)
    return dict(block_t=128, split=2048, block_k=64, num_warps=8, prefetch=False, num_stages=3)


def parts_pay(T: int, post_mix: bool = False) -> bool:
    """Whether fn's cached bf16 parts beat splitting fp32 fn in registers at T tokens: in the mixes kernel
    (_fused_tiles; session 9 round 2, T=64 with tail form 7: 9.6 us against 9.9) from 64, in the write-back +
    mixes kernel (post_mix) from 32 (session 13 R2, H = 2048, the MoE write-back at _post_mix_tiles' picks, us:
    T = 32 7.39-7.46 against 8.24-8.31; T = 8 7.40-7.46 against 7.35-7.40; R3, H = 5120, T = 32: 11.77 against
    12.51 for HEAD's fp32 fn at its same tiles)."""
    return T >= (32 if post_mix else 64)


def _precision() -> str:
    # fp32 products matter here (z feeds sigmoids and a 20-step Sinkhorn), so "ieee" (plain FMAs) when r is fp32.
    # Measured on an H200 (T=64/256/4096, H=5120): 43/115/1003 us with "ieee" against 218/540/7197 us with
    # "tf32x3"; the FMA dot is arithmetic-bound (~5 TFLOP/s). bf16 residuals take the bf16x3 path instead.
    return "ieee"


def hc_mixes_triton(residual, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20, post_mult=2.0,
                    block_t: int | None = None, block_k: int | None = None, split: int | None = None,
                    only_partial: bool = False, precision: str | None = None, fn_parts: torch.Tensor | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, prefetch: bool | None = None,
                    fast_rcp: bool | None = None, waiters: int | None = None, spc: int | None = None,
                    tail_form: int | None = None) -> HcMixes:
    """One launch (_hc_fused_kernel). precision: None picks "bf16x3" for bf16 residuals (three bf16 tensor-core
    products against a hi/mid/lo split of fn made in registers from the fp32 fn; with fn_parts =
    split_fn_bf16(fn) given, the parts are read instead) and "ieee" otherwise; "ieee"/"tf32x3"/"tf32" force the
    one-dot fp32 path. None for block_t / split / block_k / num_warps / prefetch / num_stages: _fused_tiles
    (bf16x3) or the fp32 defaults below; prefetch: each step's tiles loaded a step ahead by hand (else Triton's
    pipelining with num_stages); waiters: programs per token block that mix its tokens (default: one per token
    while the grid fits one wave, else 1); spc: splits' partials loaded at once per token; fast_rcp (None:
    FAST_RCP_DEFAULT): rcp.approx in the Sinkhorn loop; only_partial: the streaming pass alone (benchmark)."""
    _check(residual, fn, base, scale)
    T, M, H = residual.shape
    check(M & (M - 1) == 0, f"the Triton path needs a power-of-two stream count, got {M}")
    check(iters >= 1, f"sinkhorn iterations must be >= 1, got {iters}")
    K, NZ = M * H, (2 + M) * M
    NZP = max(16, triton.next_power_of_2(NZ + 1))       # column NZ carries the sum of squares
    if precision is None:
        precision = "bf16x3" if residual.dtype == torch.bfloat16 else _precision()
    split_fn = precision == "bf16x3"
    check(not split_fn or residual.dtype == torch.bfloat16, "precision bf16x3 needs a bf16 residual")
    # fp32 FMA dot: D's best in the H200 sweep (32-token blocks, 512-wide splits, block_k 128); 64-token blocks
    # spilled ~9 KB per thread and ran 50x slower
    tiles = _fused_tiles(T) if split_fn else dict(block_t=32, split=512, block_k=128, num_warps=4)
    block_t, split, block_k = block_t or tiles["block_t"], split or tiles["split"], block_k or tiles["block_k"]
    warps = num_warps or tiles["num_warps"]
    prefetch = tiles.get("prefetch", True) if prefetch is None else prefetch
    num_stages = num_stages or tiles.get("num_stages")
    dev = residual.device
    L = _split_launch(T, K, block_t, split, block_k, warps, waiters, spc, dev)
    r = residual.reshape(T, K).contiguous()
    z = empty((T, L.n_split, NZP), torch.float32, dev)
    mode = 0
    if split_fn:
        mode, w = (2, fn_parts) if fn_parts is not None else (1, fn.float().contiguous())
    else:
        w = fn.float().contiguous()
    pre = empty((T, M), torch.float32, dev)
    post = empty((T, M), torch.float32, dev)
    comb = empty((T, M, M), torch.float32, dev)
    base, scale = base.float().contiguous(), scale.float().contiguous()
    fast = (FAST_RCP_DEFAULT if fast_rcp is None else fast_rcp) and _CAN_RCP
    cnt = _counters(dev, L.n_tb)
    _hc_fused_kernel[(L.n_tb, L.n_split)](r, w, z, cnt, base, scale, pre, post, comb, T, K, NZ, L.n_split,
                                          norm_eps, hc_eps, post_mult, M=M, NZP=NZP, BT=block_t, BK=L.block_k,
                                          SPLIT=L.split, MODE=mode, PRECISION="ieee" if split_fn else precision,
                                          UPCAST=INTERPRETING, NW=L.nw, TPW=L.tpw, SPC=L.spc, ITERS=iters,
                                          FAST=fast, TAIL=not only_partial, PF=prefetch,
                                          FORM=_tail_form(tail_form, L.tpw), num_warps=warps,
                                          **({} if num_stages is None else dict(num_stages=num_stages)), **pdl_kw())
    return None if only_partial else HcMixes(pre, post, comb)


_PARTS: dict = {}      # id(fn) -> (weakref to fn, fn._version, bf16 parts): for callers that pass fn_parts


def fn_parts_cached(fn: torch.Tensor) -> torch.Tensor:
    """split_fn_bf16(fn), remembered while fn lives and is not modified in place (weights: once per layer)."""
    hit = _PARTS.get(id(fn))
    if hit is not None and hit[0]() is fn and hit[1] == fn._version:
        return hit[2]
    parts = split_fn_bf16(fn)
    for key in [k for k, v in _PARTS.items() if v[0]() is None]:      # forget weights that are gone
        del _PARTS[key]
    _PARTS[id(fn)] = (weakref.ref(fn), fn._version, parts)
    return parts


def hc_mixes(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm_eps: float = 1e-20, hc_eps: float = 1e-6, iters: int = 20, post_mult: float = 2.0) -> HcMixes:
    """(pre, post, comb) mixes of one mHC sub-layer for every token (module docstring). On CUDA: one launch;
    with a bf16 residual fn's bf16 hi/mid/lo split is made in registers below 64 tokens (fn read at 4 bytes),
    and read as cached parts (3 bf16 copies of fn, ~3 MB per sub-layer for V4.1) from 64 (parts_pay)."""
    if use_triton(residual):
        big = residual.dtype == torch.bfloat16 and parts_pay(residual.shape[0])
        return hc_mixes_triton(residual, fn, base, scale, norm_eps, hc_eps, iters, post_mult,
                               fn_parts=fn_parts_cached(fn) if big else None)
    return hc_mixes_torch(residual, fn, base, scale, norm_eps, hc_eps, iters, post_mult)


# ---------------------------------------------------------------------------------------------- apply the mixes
# Reading the streams out (pre) and writing a sub-layer's output back (post + comb) are memory-bound passes over
# R; in torch each is 3-6 launches (upcasts, products, a batched matmul, downcast). One launch each here, and the
# post pass can also produce the next sub-layer's read-out (shifted mHC: its pre-mix is already known), so the
# fresh R' is not read again for it.
def hc_pre_torch(R: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x[t] = sum_j a[t, j] * R[t, j] in fp32, R's dtype out. R [T, M, H], a [T, M] -> [T, H]."""
    _check_apply(R, a=a)
    return (a.float().unsqueeze(-1) * R.float()).sum(dim=1).to(R.dtype)


def hc_post_torch(R, y, post, comb, next_pre=None, y2=None):
    """R'[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * R[t, j] (fp32 math, R's dtype out); with next_pre
    also (R', hc_pre_torch(R', next_pre)). y2 [T, H]: a second addend of the sub-layer output (the MoE's shared
    expert beside its routed experts): y + y2 summed in fp32, so R' is rounded once."""
    _check_apply(R, y, post, comb, next_pre, y2=y2)
    yf = y.float() if y2 is None else y.float() + y2.float()
    out = (post.float().unsqueeze(-1) * yf.unsqueeze(-2) +
           torch.matmul(comb.float().transpose(-1, -2), R.float())).to(R.dtype)
    return out if next_pre is None else (out, hc_pre_torch(out, next_pre))


def _check_apply(R, y=None, post=None, comb=None, a=None, triton_path=False, y2=None):
    check(R.dim() == 3, f"residual must be [tokens, streams, hidden], got {tuple(R.shape)}")
    T, M, H = R.shape
    check(not triton_path or M & (M - 1) == 0, f"the Triton path needs a power-of-two stream count, got {M}")
    if y is not None:
        check(y.shape == (T, H), f"sub-layer output must be [{T}, {H}], got {tuple(y.shape)}")
        check(post.shape == (T, M), f"post mix must be [{T}, {M}], got {tuple(post.shape)}")
        check(comb.shape == (T, M, M), f"comb mix must be [{T}, {M}, {M}], got {tuple(comb.shape)}")
        if y2 is not None:
            check(y2.shape == (T, H), f"second addend must be [{T}, {H}], got {tuple(y2.shape)}")
    if a is not None:
        check(a.shape == (T, M), f"pre mix must be [{T}, {M}], got {tuple(a.shape)}")


@triton.jit
def _hc_pre_kernel(r_ptr, a_ptr, x_ptr, H, M: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    j = tl.arange(0, M)
    r = tl.load(r_ptr + (t * M + j[:, None]) * H + h[None, :], mask=h[None, :] < H, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t * M + j)
    tl.store(x_ptr + t * H + h, tl.sum(a[:, None] * r, 0).to(x_ptr.dtype.element_ty), mask=h < H)


@triton.jit
def _load_y(y_ptr, y2_ptr, offs, mask, Y2: tl.constexpr):
    """The sub-layer output at offs in fp32; Y2: plus the second addend's (one fp32 sum, no rounding between)."""
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if Y2:
        y += tl.load(y2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _hc_post_kernel(r_ptr, y_ptr, y2_ptr, post_ptr, comb_ptr, a_ptr, out_ptr, x_ptr, H, M: tl.constexpr,
                    BH: tl.constexpr, PRE: tl.constexpr, Y2: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, hidden block): R'[k] = post[k] y + sum_j comb[j, k] R[j]; PRE: also x = sum_k a[k] R'[k]
    from the rounded R' (what a separate read-out would see); Y2: y is y + y2 (_load_y)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    j = tl.arange(0, M)
    r = tl.load(r_ptr + (t * M + j[:, None]) * H + h[None, :], mask=hm[None, :], other=0.0).to(tl.float32)
    y = _load_y(y_ptr, y2_ptr, t * H + h, hm, Y2)
    post = tl.load(post_ptr + t * M + j)
    comb = tl.load(comb_ptr + t * M * M + j[:, None] * M + j[None, :])               # [j, k]
    mixed = tl.sum(comb[:, :, None] * r[:, None, :], 0)                               # [k, BH]
    out = (post[:, None] * y[None, :] + mixed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (t * M + j[:, None]) * H + h[None, :], out, mask=hm[None, :])
    if PRE:
        a = tl.load(a_ptr + t * M + j)
        tl.store(x_ptr + t * H + h, tl.sum(a[:, None] * out.to(tl.float32), 0).to(x_ptr.dtype.element_ty), mask=hm)


def _block_h(H: int) -> int:
    return min(512, triton.next_power_of_2(H))


def hc_pre_triton(R, a):
    _check_apply(R, a=a, triton_path=True)
    T, M, H = R.shape
    R = R.contiguous()
    x = empty((T, H), R.dtype, R.device)
    if T:
        _hc_pre_kernel[(T, triton.cdiv(H, _block_h(H)))](R, a.float().contiguous(), x, H, M=M, BH=_block_h(H),
                                                         num_warps=4, **pdl_kw())
    return x


def hc_post_triton(R, y, post, comb, next_pre=None, block_h=256, num_warps=1, y2=None):
    """block_h / num_warps: H200 session 7 round 2 (T=64 / 256): 256 / 1 warp 4.0 / 9.3 us, 256 / 2 4.1 / 10.1,
    128 / 1 4.4 / 9.6, 512 / 2 4.3 / 9.7, 1024 / 4 4.3 / 10.0, 64 / 1 5.5 / 14.8; one launch that only reads
    the same bytes takes 3.4 / 7.6 us. y2: hc_post_torch's second addend.
    Session 11 round 3 (H = 5120, bf16, us at T = 8 / 64 / 256): the read-out costs this launch 0.6 / 0.7 / 1.9
    (2.3 / 3.2 / 7.4 with it, 1.7 / 2.5 / 5.5-5.7 without). Measured and deleted: the last layer's write-back with
    the model's final norm in the same launch (one program a token holding the whole row, R' not stored; 8, 16 or
    32 warps) 5.5-5.7 / 5.7-5.9 / 8.9-11.5 against 4.4 / 5.4 / 10.5 for this write-back + read-out then
    kernels.rmsnorm, and its read-out was not bit-equal to this kernel's on the H200."""
    _check_apply(R, y, post, comb, next_pre, triton_path=True, y2=y2)
    T, M, H = R.shape
    R = R.contiguous()
    out = empty((T, M, H), R.dtype, R.device)
    x = empty((T, H), R.dtype, R.device) if next_pre is not None else out
    a = next_pre.float().contiguous() if next_pre is not None else post
    bh = block_h or _block_h(H)
    if T:
        y = y.contiguous()
        _hc_post_kernel[(T, triton.cdiv(H, bh))](R, y, y if y2 is None else y2.contiguous(),
                                                 post.float().contiguous(), comb.float().contiguous(), a, out, x, H,
                                                 M=M, BH=bh, PRE=next_pre is not None, Y2=y2 is not None,
                                                 num_warps=num_warps, **pdl_kw())
    return out if next_pre is None else (out, x)


@triton.jit
def _bcast(p, ok):
    return tl.load(p, mask=ok, other=0.0)[:, None]


@triton.jit
def _pin(x, INTERP: tl.constexpr):
    """x unchanged, through an opaque move: the compiler then converts the one result to the layouts its uses
    need instead of recomputing it from its inputs in each (it did: R's four streams and y held in three
    layouts, 246 registers). The interpreter cannot run PTX."""
    if INTERP:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _write_back(r0, r1, r2, r3, yv, post_ptr, comb_ptr, toks, tok_ok, k):
    """Destination stream k of R' for a [BT, BK] tile (M = 4): post[k] y + sum_j comb[j, k] R_j, fp32."""
    c = comb_ptr + toks * 16 + k
    return (_bcast(post_ptr + toks * 4 + k, tok_ok) * yv + _bcast(c, tok_ok) * r0 + _bcast(c + 4, tok_ok) * r1
            + _bcast(c + 8, tok_ok) * r2 + _bcast(c + 12, tok_ok) * r3)


@triton.jit
def _post_mix_stream(r0, r1, r2, r3, yv, post_ptr, comb_ptr, a_ptr, op, fn_ptr, toks, tok_ok, m, h, hok, zs, acc, x,
                     sq, k, H, K, NZ, MODE: tl.constexpr, UPCAST: tl.constexpr):
    """Destination stream k of one BK-wide step of _hc_post_mix_kernel: R'_k stored, added to the read-out x, its
    squares to sq and its products with fn's columns k*H + h to acc."""
    o = _pin(_write_back(r0, r1, r2, r3, yv, post_ptr, comb_ptr, toks, tok_ok, k), UPCAST)
    o = o.to(op.dtype.element_ty)
    tl.store(op + k * H, o, mask=m)
    of = o.to(tl.float32)
    x += _bcast(a_ptr + toks * 4 + k, tok_ok) * of
    sq += tl.sum(of * of, 1)
    a, b, c = _fn_tiles(fn_ptr, K, NZ, zs, k * H + h, hok, MODE)
    acc = _add_products(acc, o, a, b, c, MODE, "ieee", UPCAST)
    return acc, x, sq


@triton.jit
def _hc_post_mix_kernel(r_ptr, y_ptr, y2_ptr, post_ptr, comb_ptr, a_ptr, out_ptr, x_ptr, fn_ptr, z_ptr, cnt_ptr,
                        base_ptr, scale_ptr, pre2_ptr, post2_ptr, comb2_ptr, w_ptr, xsq_ptr, T, H, NZ, n_split,
                        norm_eps, hc_eps, post_mult, x_eps, NZP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        SPLIT: tl.constexpr, MODE: tl.constexpr, UPCAST: tl.constexpr, NW: tl.constexpr,
                        TPW: tl.constexpr, SPC: tl.constexpr, ITERS: tl.constexpr, FAST: tl.constexpr,
                        TAIL: tl.constexpr, FORM: tl.constexpr, Y2: tl.constexpr, NORM: tl.constexpr,
                        NSP: tl.constexpr, PDL: tl.constexpr = False):
    """The write-back R' = post y + comb^T R (M = 4), the next read-out x = sum_k a_k R'_k, and the NEXT
    sub-layer's mixes of R' in one launch. Program (token block tb, split sp of the H hidden columns): for each
    BK-wide step it reads R's 4 streams and y (Y2: y + y2, _load_y), forms the 4 streams of R' (rounded to R's
    dtype: what a separate mixes launch would read), stores them and x, and adds their products with fn's columns
    k*H + h to its partial z (as _hc_fused_kernel's first pass, on R' instead of a loaded R); _finish_block then
    stores the partial and the last NW starters of the token block mix its tokens into pre2 / post2 / comb2.
    NORM (1 / 2, _finish_block): x then RMSNorm-ed in place with the weight w (its rows' sums of squares, of x as
    rounded, stored per split in xsq [T, n_split]). TAIL=False: no mixing (benchmark breakdown).
    PDL: the wait comes first (R, y, the mixes and the tickets are the step's); no early trigger (the next
    kernel's programs must not take the slots this grid's not-yet-started programs need: they spin on each other)."""
    pdl_wait(PDL)
    tb = tl.program_id(0)
    sp = tl.program_id(1)
    toks = tb * BT + tl.arange(0, BT)
    tok_ok = toks < T
    zs = tl.arange(0, NZP)
    acc = tl.zeros([BT, NZP], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    xsq = tl.zeros([BT], tl.float32)
    ticket = 0
    if TAIL:
        ticket = tl.atomic_add(cnt_ptr + 2 * tb, 1, sem="relaxed", scope="gpu")
    row = toks[:, None].to(tl.int64)
    K = 4 * H
    for i in range(0, SPLIT // BK):
        h = sp * SPLIT + i * BK + tl.arange(0, BK)
        hok = h < H
        m = tok_ok[:, None] & hok[None, :]
        rp = r_ptr + row * K + h[None, :]
        r0 = tl.load(rp, mask=m, other=0.0).to(tl.float32)
        r1 = tl.load(rp + H, mask=m, other=0.0).to(tl.float32)
        r2 = tl.load(rp + 2 * H, mask=m, other=0.0).to(tl.float32)
        r3 = tl.load(rp + 3 * H, mask=m, other=0.0).to(tl.float32)
        yv = _load_y(y_ptr, y2_ptr, row * H + h[None, :], m, Y2)
        op = out_ptr + row * K + h[None, :]
        x = tl.zeros([BT, BK], tl.float32)
        for k in range(0, 4):           # a loop, not unrolled: one stream's fn tiles live at a time
            acc, x, sq = _post_mix_stream(r0, r1, r2, r3, yv, post_ptr, comb_ptr, a_ptr, op, fn_ptr, toks, tok_ok, m,
                                          h, hok, zs, acc, x, sq, k, H, K, NZ, MODE, UPCAST)
        xr = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * H + h[None, :], xr, mask=m)
        if NORM:
            xf = xr.to(tl.float32)
            xsq += tl.sum(xf * xf, 1)
    if NORM:                            # (stored before _finish_block's release, like the partial z)
        tl.store(xsq_ptr + toks.to(tl.int64) * n_split + sp, xsq, mask=tok_ok)
    _finish_block(acc, sq, ticket, z_ptr, cnt_ptr, base_ptr, scale_ptr, pre2_ptr, post2_ptr, comb2_ptr, T, K, NZ,
                  n_split, norm_eps, hc_eps, post_mult, tb, sp, toks, x_ptr, w_ptr, xsq_ptr, H, x_eps, sp * SPLIT,
                  sp * SPLIT + SPLIT, 4, NZP, BT, NW, TPW, SPC, ITERS, FAST, TAIL, FORM, NORM if TAIL else 0, BK,
                  NSP)


@triton.jit
def _mix_partials_kernel(z_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NZ, n_split, norm_eps,
                         hc_eps, post_mult, NZP: tl.constexpr, TPW: tl.constexpr, SPC: tl.constexpr,
                         ITERS: tl.constexpr, FAST: tl.constexpr, REG: tl.constexpr, PDL: tl.constexpr = False):
    """The mixing tail of _hc_post_mix_kernel as a launch of its own (hc_post_mix_triton's defer, M = 4): program p
    adds the partial z rows of tokens p * TPW .. (p + 1) * TPW - 1 (SPC splits at a time) and mixes them
    (_mix_rows): the waiters' bits where TPW and SPC are theirs (_finish_tokens). PDL: the wait first (the
    partials are the step's); no early trigger (it runs beside the next sub-layer, on a side stream)."""
    pdl_wait(PDL)
    mt = tl.program_id(0) * TPW + tl.arange(0, TPW)
    ok = mt < T
    z = tl.zeros([TPW, NZP], tl.float32)
    for s0 in range(0, n_split, SPC):
        z += tl.sum(_partials(z_ptr, mt, ok, s0, n_split, NZ, NZP, SPC), 1)
    _mix_rows(z, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, K, NZ, norm_eps, hc_eps, post_mult, mt, ok, 4,
              NZP, ITERS, FAST, REG)


def _post_mix_tiles(T: int, H: int, dev) -> dict:
    """The write-back + mixes kernel's tiles at T tokens of H hidden columns: 16-token blocks, and the narrowest
    split (16 to 128 columns, steps of up to 64) that keeps the grid within one program an SM, or 128-wide: the
    programs' walks over their columns are chains of dependent loads, so the more programs the shorter each chain,
    until programs share SMs. This reproduces every V4.1 (H = 5120) pick of sessions 8-10 (64-wide splits up to 16
    tokens, 128-wide above). H200 session 13 R1 (the mid-size H = 2048, the MoE write-back with y2 and the read-out
    norm, PDL on, us a call in a CUDA graph): T = 8 / 16 splits 64 (then the default) 7.89 / 8.03, 32 7.57 / 7.69,
    16 7.12 / 7.18; T = 32 split 128 (then the default) 12.41, 64 8.18, 32 8.11; T = 64 split 128 (then the default)
    10.76 (its streaming pass alone 6.51), 64 8.26 (4.04), 32 10.08 (256 programs); T = 128 128 12.55, 64 12.32.
    R3 (fn parts from 32 tokens), programs of 2 / 1 warps at these tiles: T = 8 7.26 / 8.65 against 7.13 with 4;
    T = 32 2 warps 7.84 against 7.21; T = 64 9.60 against 8.27.
    H200 session 8 (us, T = 8 / 64 / 256;
    the two launches it replaces 11.8-12.4 / 14.7-15.0 / 24.6-25.3): 16-token blocks in 64-wide steps, 64-wide
    splits 9.0-9.4 / 16.3 / 34.0, 128-wide 12.5 / 15.4-15.5 / 29.7-29.9, 256-wide - / 20.1 / 30.0; 128-wide steps
    (spill) - / 21.7 / 42.6; 8 warps - / - / 53.6; 32-token blocks (fn tiles a stream ahead) - / 18.0 / 42.0.
    Measured and deleted (round 2): each stream's fn tiles loaded a stream ahead 13.8 / 16.4-16.6 / 29.9-30.7,
    the four streams unrolled 22.0 / 34.5 (T = 64 / 256; ~90-120 KB of shared memory a program), both 19.3 / 33.5.
    Its streaming pass alone takes 11.3 us at T = 64, as long as the two launches' (4.1 + 6.0): the
    sixteen-token dots against fn's columns do not hide under the write-back's traffic."""
    split, n_tb = 16, triton.cdiv(T, 16)
    while split < 128 and not one_wave(n_tb * triton.cdiv(H, split), dev):
        split *= 2
    return dict(block_t=16, split=split, block_k=min(64, split), num_warps=4)


# Without the read-out's norm the write-back + mixes kernel replaces the two launches up to this many tokens
# (session 8 rounds 1-2, H = 5120: it wins at T = 8, ties or loses at 64, loses at 256). With it (x_norm) the one
# launch also saves the norm launch, wherever its grid is resident at once (norm form 2): session 10 round 2
# (H = 5120, us, T = 32 / 64): 13.8 / 15.1 against 15.1 / 16.7 for the write-back, mixes and norm launches;
# session 13 R1 (H = 2048, the MoE write-back, T = 128 / 256): 12.55 / 17.44 against 14.20 / 18.74. (At H = 5120
# the grid is resident up to 96 tokens on an H200: T = 80 / 96 in the module docstring.)
POST_MIX_MAX_T = 16
# Up to this many tokens hc_post_mix_apply(defer=True) leaves the mixes' tail to HcMixes.finish (engine/mhc.py runs
# it on a side stream beside the next sub-layer). H200 (mid-size H = 2048, two write-backs + mixes + norm through
# engine/mhc.hc_post_and_mixes with four 2048 x 2048 GEMM-library products after each, the next write-back joining
# the side stream, 16 calls in a CUDA graph, us a call, tail inside -> deferred; .round scripts and
# benchmarks/kernels_moe.py's "write-back chain" rows). Session 14 (a program a token), R3: T = 8 59.86-59.90 ->
# 55.99-56.23, T = 16 60.67-60.79 -> 56.73, T = 32 61.40 -> 63.75, T = 64 60.84 -> 66.89. Session 15 R1 (16 tokens
# a finish program: _finish_tokens, the module docstring says why): T = 32 60.45-64.26 -> 56.37-56.62 (a program a
# token 62.60-62.68), T = 64 63.35-63.79 -> 58.59-59.48 (63.44-66.84); T = 16, a program a token, 59.07-59.18 ->
# 56.19-56.27. With skinny products as the stand-in (one-wave Triton grids) T = 64 57.16-57.22 -> 57.10-57.13.
# R3 (16 tokens a program; a program a token in brackets): T = 8 58.16-58.23 -> 53.46-53.52 (53.93-54.20), T = 16
# 57.92-58.05 -> 53.55-53.84 (54.27-54.33), T = 64 60.36-64.13 -> 56.85-58.54, T = 128 77.00-80.94 -> 71.54-71.91,
# T = 256 87.02-90.63 -> 90.36-90.62 (not deferred there).
DEFER_MAX_T = 128
# Tokens a deferred finish program mixes at least (_finish_tokens).
DEFER_GROUP = 16


def _finish_tokens(L: _SplitLaunch) -> tuple:
    """(tokens a program, splits' partials loaded at once) of the deferred finish (_mix_partials_kernel) after the
    launch L: the waiters' (L.tpw, L.spc) where they mix DEFER_GROUP tokens or more each (the same bits), else
    DEFER_GROUP tokens a program (the partials' sums then in another order than the waiters': within fp32
    rounding). A program a token put T programs beside the sub-layer after the write-back, whose first product
    waited for the SMs they took (module docstring, session 15)."""
    if L.tpw >= DEFER_GROUP:
        return L.tpw, L.spc
    return DEFER_GROUP, _partials_at_once(L.n_split, DEFER_GROUP)


def _post_mix_launch(T: int, H: int, dev, block_t=None, split=None, block_k=None, num_warps=None, waiters=None,
                     spc=None) -> _SplitLaunch:
    """The write-back + mixes launch's shape at T tokens of H hidden columns (_post_mix_tiles where not given)."""
    t = _post_mix_tiles(T, H, dev)
    return _split_launch(T, H, block_t or t["block_t"], split or t["split"], block_k or t["block_k"],
                         num_warps or t["num_warps"], waiters, spc, dev)


def hc_post_mix_torch(R, y, post, comb, next_pre, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20,
                      post_mult=2.0, y2=None, x_norm=None):
    """Twin of hc_post_mix_triton: (R', x, HcMixes of R') from hc_post_torch (y2: its second addend) and
    hc_mixes_torch; x_norm = (fp32 weight [H], eps): x is then RMSNorm-ed (kernels.rmsnorm's twin on x as
    rounded)."""
    out, x = hc_post_torch(R, y, post, comb, next_pre, y2)
    if x_norm is not None:
        x = rms_norm_torch(x, *x_norm)
    return out, x, hc_mixes_torch(out, fn, base, scale, norm_eps, hc_eps, iters, post_mult)


def hc_post_mix_triton(R, y, post, comb, next_pre, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20,
                       post_mult=2.0, block_t: int | None = None, split: int | None = None,
                       block_k: int | None = None, num_warps: int | None = None,
                       fn_parts: torch.Tensor | None = None, waiters: int | None = None, spc: int | None = None,
                       fast_rcp: bool | None = None, only_partial: bool = False, tail_form: int | None = None,
                       y2: torch.Tensor | None = None, x_norm: tuple | None = None, norm_form: int | None = None,
                       launch: _SplitLaunch | None = None, defer: bool = False):
    """One launch (_hc_post_mix_kernel, M = 4): (R', x, the next sub-layer's HcMixes of R'), equal to
    hc_post_mix_torch up to fp32 summation order. split / block_k count hidden columns (each covers the 4
    streams); fn_parts: split_fn_bf16(fn) read instead of splitting fp32 fn in registers (bf16 R only); waiters /
    spc / fast_rcp as hc_mixes_triton; y2: hc_post_torch's second addend; x_norm = (fp32 weight [H], eps): x
    RMSNorm-ed in the same launch (_finish_block's NORM; norm_form 1 / 2 forces a form, default 2 while the grid
    is resident at once, else 1). Cost: R read once, R' written once, y read, x written, fn read once per token
    block (L2 hits after the first), the partials through L2. only_partial: no mixing (benchmark: the mixes'
    outputs are left unwritten, and x is not normalised even with x_norm). launch: the launch shape already made
    by _post_mix_launch (hc_post_mix_apply; the tile arguments are then not used). defer (with x_norm only in
    norm form 2): the launch ends once R', x and x's norm are stored, and the mixes' reduction and Sinkhorn are
    left to the returned HcMixes' `finish` (_mix_partials_kernel, the same bits): nothing reads them before the
    sub-layer after this one, so they can run beside it (engine/mhc.py runs them on a side stream)."""
    _check_apply(R, y, post, comb, next_pre, triton_path=True, y2=y2)
    check(next_pre is not None, "the write-back + mixes pass needs the next pre-mix")
    T, M, H = R.shape
    check(M == 4, f"the write-back + mixes kernel is written for 4 streams, got {M}")
    _check(R, fn, base, scale)
    check(iters >= 1, f"sinkhorn iterations must be >= 1, got {iters}")
    NZ = (2 + M) * M
    NZP = max(16, triton.next_power_of_2(NZ + 1))
    dev = R.device
    L = launch or _post_mix_launch(T, H, dev, block_t, split, block_k, num_warps, waiters, spc)
    R = R.contiguous()
    bf16 = R.dtype == torch.bfloat16
    check(fn_parts is None or bf16, "fn parts need a bf16 residual")
    mode, w = (2, fn_parts) if fn_parts is not None else (1 if bf16 else 0, fn.float().contiguous())
    out = empty((T, M, H), R.dtype, dev)
    x = empty((T, H), R.dtype, dev)
    z = empty((T, L.n_split, NZP), torch.float32, dev)
    mixes = HcMixes(empty((T, M), torch.float32, dev), empty((T, M), torch.float32, dev),
                    empty((T, M, M), torch.float32, dev))
    fast = (FAST_RCP_DEFAULT if fast_rcp is None else fast_rcp) and _CAN_RCP
    nw, xsq, x_eps, form = x, x, 0.0, 0
    if x_norm is not None:
        nw, x_eps = x_norm
        check(nw.shape == (H,) and nw.dtype == torch.float32, f"the read-out norm's weight must be fp32 [{H}]")
        xsq = empty((T, L.n_split), torch.float32, dev)
        form = norm_form or (2 if L.resident else 1)
        check(form == 1 or L.resident, "read-out norm form 2 needs the whole grid resident at once (a GPU)")
    defer = defer and form != 1 and not only_partial and T > 0
    b32, s32 = base.float().contiguous(), scale.float().contiguous()
    tail_form = _tail_form(tail_form, L.tpw)
    if defer:   # no waiters: every program normalises x (form 2), or (no norm) stores its partials and ends
        # the outputs bound first: a lambda holding `mixes` itself would be a cycle (mixes -> finish -> mixes),
        # freed with its workspace only by the cycle collector
        m_pre, m_post, m_comb = mixes.pre, mixes.post, mixes.comb
        tpw, spc = _finish_tokens(L)
        mixes.finish = lambda: _mix_partials_kernel[(triton.cdiv(T, tpw),)](
            z, b32, s32, m_pre, m_post, m_comb, T, 4 * H, NZ, L.n_split, norm_eps, hc_eps, post_mult,
            NZP=NZP, TPW=tpw, SPC=spc, ITERS=iters, FAST=fast, REG=(tail_form & 2) != 0, num_warps=L.warps,
            **pdl_kw())
    if T:
        y = y.contiguous()
        _hc_post_mix_kernel[(L.n_tb, L.n_split)](
            R, y, y if y2 is None else y2.contiguous(), post.float().contiguous(), comb.float().contiguous(),
            next_pre.float().contiguous(), out, x, w, z, _counters(dev, L.n_tb), b32, s32,
            mixes.pre, mixes.post, mixes.comb, nw.contiguous(), xsq, T, H, NZ, L.n_split, norm_eps, hc_eps,
            post_mult, x_eps, NZP=NZP, BT=L.block_t, BK=L.block_k, SPLIT=L.split, MODE=mode, UPCAST=INTERPRETING,
            NW=0 if defer else L.nw, TPW=L.tpw, SPC=L.spc, ITERS=iters, FAST=fast,
            TAIL=not only_partial and not (defer and form == 0), FORM=tail_form, Y2=y2 is not None, NORM=form,
            NSP=triton.next_power_of_2(L.n_split), num_warps=L.warps, **pdl_kw())
    return out, x, mixes


def hc_pre_apply(R: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Read one hidden [T, H] out of the streams R [T, M, H] with the weights a [T, M] (one launch on CUDA)."""
    return hc_pre_triton(R, a) if use_triton(R) else hc_pre_torch(R, a)


def hc_post_apply(R, y, post, comb, next_pre=None, y2=None):
    """R' = post * y + comb^T R per token (one launch on CUDA); next_pre [T, M]: also return the read-out of
    R' with those weights, (R', x), from the same pass; y2: a second addend of y (hc_post_torch)."""
    if use_triton(R):
        return hc_post_triton(R, y, post, comb, next_pre, y2=y2)
    return hc_post_torch(R, y, post, comb, next_pre, y2)


def hc_post_mix_apply(R, y, post, comb, next_pre, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20,
                      post_mult=2.0, y2=None, x_norm=None, defer=False):
    """The write-back R' = post * y + comb^T R (y2: a second addend of y, hc_post_torch), the read-out x of R'
    with next_pre (x_norm = (fp32 weight, eps): RMSNorm-ed), and the mixes of R' for the sub-layer with
    parameters (fn, base, scale): (R', x, HcMixes). On CUDA with 4 streams one launch (hc_post_mix_triton; fn as
    cached bf16 parts from 32 tokens, parts_pay) up to POST_MIX_MAX_T tokens, and with x_norm wherever its
    grid is resident at once; else hc_post_apply then hc_mixes (then kernels.rmsnorm.rms_norm; the twins on CPU).
    defer: the one launch leaves the mixes to the returned HcMixes' `finish` where it can (hc_post_mix_triton), up
    to DEFER_MAX_T tokens."""
    T = R.shape[0]
    L = _post_mix_launch(T, R.shape[2], R.device) if use_triton(R) and R.shape[1] == 4 else None
    # the norm joins the launch only in its fast form (2: the whole grid resident at once); form 1 costs more than
    # the separate norm launch (26.6 / 41.2 us at T = 8 / 64 on the H200, session 10), so a grid that is not
    # resident keeps the write-back + mixes launch (up to POST_MIX_MAX_T tokens) and norms after it
    fused_norm = L is not None and x_norm is not None and L.resident
    if L is not None and (T <= POST_MIX_MAX_T or fused_norm):
        parts = fn_parts_cached(fn) if R.dtype == torch.bfloat16 and parts_pay(T, post_mix=True) else None
        out, x, mixes = hc_post_mix_triton(R, y, post, comb, next_pre, fn, base, scale, norm_eps, hc_eps, iters,
                                           post_mult, fn_parts=parts, y2=y2, x_norm=x_norm if fused_norm else None,
                                           launch=L, defer=defer and T <= DEFER_MAX_T)
    else:
        out, x = hc_post_apply(R, y, post, comb, next_pre, y2)
        mixes = hc_mixes(out, fn, base, scale, norm_eps, hc_eps, iters, post_mult)
    return out, (rms_norm(x, *x_norm) if x_norm is not None and not fused_norm else x), mixes
