"""Manifold-constrained hyper-connection mixes (V4.1 mHC, architecture doc section 2.2), fused.

From the M residual streams R [T, M, H] of each token and a sub-layer's parameters fn [(2+M)*M, M*H],
base [(2+M)*M], scale [3] (all fp32; the RMSNorm weight is already folded into fn's columns):
  r    = flatten(R) in fp32;  z = (r @ fn^T) * rsqrt(mean(r^2) + norm_eps)
  pre  = sigmoid(z[:M] * scale[0] + base[:M]) + hc_eps                       [T, M]
  post = sigmoid(z[M:2M] * scale[1] + base[M:2M]) * post_mult                [T, M]
  C    = softmax_rows(z[2M:] * scale[2] + base[2M:] as [M, M]) + hc_eps, then a column normalisation,
         then (iters - 1) x (row normalisation, column normalisation); each divides by (sum + hc_eps)   [T, M, M]
C[j, k] mixes source stream j into destination stream k.

Triton, two launches (the working set is a few MB, so latency is the cost, not bytes): programs (token block,
split of the M*H columns) each read their tile of R once and write a partial z with the sum of squares in its
padding column; then programs of a few tokens add the partials in split order (deterministic) and mix: sigmoids
on the summed [tokens, NZ] block, then each token's softmax + Sinkhorn steps inside one thread (M = 4; no
cross-lane sums).
Cost: T*M*H*bytes(R) + |fn| (fp32 fn, L2 hits after the first token block) + the partials (n_split*T*32*4 B).
The product r . fn^T needs fp32 accuracy: bf16 residuals (the model's) take three bf16 tensor-core products
against a hi/mid/lo bf16 split of fn made in registers (exact products, fp32 accumulation); fp32 residuals use
Triton's "ieee" dot (FMAs: D measured it arithmetic-bound, 1-3% of bandwidth on an H200).
"""
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import INTERPRETING, check, empty, use_triton

_CAN_RCP = not INTERPRETING      # hardware reciprocals (rcp.approx) need compiled kernels


@dataclass
class HcMixes:
    pre: torch.Tensor    # fp32 [T, M]: read-out weights for the next sub-layer's input
    post: torch.Tensor   # fp32 [T, M]: write-back weights of this sub-layer's output
    comb: torch.Tensor   # fp32 [T, M, M]: stream mixing, C[t, j, k] = source j -> destination k


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
def _rw_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, k0, live, BK: tl.constexpr):
    """r [BT, BK] and fp32 fn [NZP, BK] at columns k0.. (nothing loaded where `live` is False)."""
    ks = k0 + tl.arange(0, BK)
    r = tl.load(r_ptr + toks[:, None].to(tl.int64) * K + ks[None, :],
                mask=(toks[:, None] < T) & (ks[None, :] < K) & live, other=0.0)
    w = tl.load(fn_ptr + zs[:, None] * K + ks[None, :], mask=(zs[:, None] < NZ) & (ks[None, :] < K) & live,
                other=0.0)
    return r, w


@triton.jit
def _partial_z(r_ptr, fn_ptr, T, K, NZ, tb, sp, BT: tl.constexpr, NZP: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               PF: tl.constexpr = False):
    """z [BT, NZP] of token block tb over the columns of split sp, with the sum of squares of r in column NZ.
    MODE 0: one fp32 dot (PRECISION) against fp32 fn. MODE 1: bf16 r and fp32 fn split in registers into
    hi + mid + lo bf16 parts (== fn to ~2**-24): three bf16 tensor-core products, exact in fp32 accumulation,
    reading fn at 4 bytes. MODE 2: the same with fn given as the three bf16 parts [3, NZ, K] (6 bytes).
    UPCAST: the interpreter computes bf16 dots wrongly, so it takes them in fp32 (same exact products).
    PF (modes 0, 1): the next step's r and fn tiles are loaded before this step's products (the compiler does
    not pipeline fn's load, whose value goes through the split before any dot).
    Measured and deleted (H200, T=64, session 5 round 2): tiles through tensor descriptors, pipelined 3-4 deep in
    shared memory: first pass 16.4 us (fn parts: 9.1) against 7.6 with pointers, whole op 22.3 against 12.5
    (T=4096, parts: 141 against 149 us); the sum of squares as the diagonal of r . r^T on the tensor cores: fewer
    instructions, but 15.3 us against 12.5."""
    toks = tb * BT + tl.arange(0, BT)
    zs = tl.arange(0, NZP)
    acc = tl.zeros([BT, NZP], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    NI: tl.constexpr = SPLIT // BK
    if PF:
        rn, wn = _rw_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, sp * SPLIT, True, BK)
    for i in range(0, NI):                   # a loop, not unrolled: unrolling hoisted every load and spilled
        if PF:
            r, w = rn, wn
            rn, wn = _rw_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, sp * SPLIT + (i + 1) * BK, i + 1 < NI, BK)
        elif MODE != 2:
            r, w = _rw_tiles(r_ptr, fn_ptr, T, K, NZ, toks, zs, sp * SPLIT + i * BK, True, BK)
        else:
            ks = sp * SPLIT + i * BK + tl.arange(0, BK)
            r = tl.load(r_ptr + toks[:, None].to(tl.int64) * K + ks[None, :],
                        mask=(toks[:, None] < T) & (ks[None, :] < K), other=0.0)
        rf = r.to(tl.float32)
        if MODE == 0:
            acc += tl.dot(rf, tl.trans(w), input_precision=PRECISION)
        else:
            if MODE == 1:
                hi = w.to(tl.bfloat16)
                rest = w - hi.to(tl.float32)
                mid = rest.to(tl.bfloat16)
                lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            else:
                wmask = (zs[:, None] < NZ) & (ks[None, :] < K)
                hi = tl.load(fn_ptr + zs[:, None].to(tl.int64) * K + ks[None, :], mask=wmask, other=0.0)
                mid = tl.load(fn_ptr + (NZ + zs[:, None]).to(tl.int64) * K + ks[None, :], mask=wmask, other=0.0)
                lo = tl.load(fn_ptr + (2 * NZ + zs[:, None]).to(tl.int64) * K + ks[None, :], mask=wmask, other=0.0)
            if UPCAST:
                acc += tl.dot(rf, tl.trans(hi.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(rf, tl.trans(mid.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(rf, tl.trans(lo.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(r, tl.trans(hi))
                acc += tl.dot(r, tl.trans(mid))
                acc += tl.dot(r, tl.trans(lo))
        sq += tl.sum(rf * rf, 1)
    return tl.where(zs[None, :] == NZ, sq[:, None], acc)


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
def _sinkhorn4(comb_ptr, toks, tok_ok, hc_eps, ITERS: tl.constexpr, FAST: tl.constexpr):
    """M = 4: each token's 16 logits (just written to comb) reloaded as 16 [BT] tensors, so a token's whole
    softmax + Sinkhorn runs inside one thread with explicit sums: no cross-lane traffic in the 2 * ITERS serial
    steps (a [BT, 4, 4] block spends shuffles on every step; [BT, 4] row tensors too, unless BT * 4 exceeds
    the program's threads). Same arithmetic as the twin up to the reciprocal (one per row / column, then
    products)."""
    o = comb_ptr + toks * 16
    c00, c01, c02, c03 = _load4(o, tok_ok)
    c10, c11, c12, c13 = _load4(o + 4, tok_ok)
    c20, c21, c22, c23 = _load4(o + 8, tok_ok)
    c30, c31, c32, c33 = _load4(o + 12, tok_ok)
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
def _finish(z_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NZ, n_split, norm_eps, hc_eps, post_mult,
            tb, M: tl.constexpr, NZP: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr, SC: tl.constexpr,
            FAST: tl.constexpr):
    """Token block tb: add the split partials z [n_split, T, NZP] in split order (SC splits' loads in flight;
    whole [BT, NZP] rows, so every thread adds its own elements: no cross-lane sums, and a fixed order, so
    deterministic; the loads bypass L1 since other programs wrote them), then the sigmoids on the [BT, NZP]
    block; the comb logits go to the output and come back per token for the Sinkhorn loop (a CTA barrier
    between: the same program wrote them)."""
    toks = tb * BT + tl.arange(0, BT)
    tok_ok = toks < T
    n = tl.arange(0, NZP)
    acc = tl.zeros([BT, NZP], tl.float32)
    for s0 in range(0, n_split, SC):
        for i in tl.static_range(SC):
            s = s0 + i
            acc += tl.load(z_ptr + (s * T + toks)[:, None].to(tl.int64) * NZP + n[None, :],
                           mask=tok_ok[:, None] & (s < n_split), other=0.0, cache_modifier=".cg")
    sq = tl.sum(tl.where(n[None, :] == NZ, acc, 0.0), 1)
    inv_rms = 1.0 / tl.sqrt(sq / K + norm_eps)
    scale = tl.where(n < M, tl.load(scale_ptr), tl.where(n < 2 * M, tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)))
    x = acc * inv_rms[:, None] * scale[None, :] + tl.load(base_ptr + n, mask=n < NZ, other=0.0)[None, :]
    sig = tl.sigmoid(x)
    row = toks[:, None]
    col = n[None, :]
    tl.store(pre_ptr + row * M + col, sig + hc_eps, mask=tok_ok[:, None] & (col < M))
    tl.store(post_ptr + row * M + (col - M), sig * post_mult, mask=tok_ok[:, None] & (col >= M) & (col < 2 * M))
    tl.store(comb_ptr + row * (M * M) + (col - 2 * M), x, mask=tok_ok[:, None] & (col >= 2 * M) & (col < NZ))
    tl.debug_barrier()                  # the logits other threads stored are read back below
    if M == 4:
        _sinkhorn4(comb_ptr, toks, tok_ok, hc_eps, ITERS, FAST)
    else:
        _sinkhorn_block(comb_ptr, toks, tok_ok, hc_eps, M, ITERS, FAST)


@triton.jit
def _hc_partial_kernel(r_ptr, fn_ptr, z_ptr, T, K, NZ, BT: tl.constexpr, NZP: tl.constexpr, BK: tl.constexpr,
                       SPLIT: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       PF: tl.constexpr):
    """First launch, program (token block, split of M*H): partial z = r . fn with the sum of r^2 over the split's
    columns in column NZ, stored per split."""
    tb = tl.program_id(0)
    sp = tl.program_id(1)
    acc = _partial_z(r_ptr, fn_ptr, T, K, NZ, tb, sp, BT, NZP, BK, SPLIT, MODE, PRECISION, UPCAST, PF)
    toks = tb * BT + tl.arange(0, BT)
    zs = tl.arange(0, NZP)
    tl.store(z_ptr + (sp * T + toks[:, None]).to(tl.int64) * NZP + zs[None, :], acc, mask=toks[:, None] < T)


@triton.jit
def _hc_mix_kernel(z_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NZ, n_split, norm_eps, hc_eps,
                   post_mult, M: tl.constexpr, NZP: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr,
                   SC: tl.constexpr, FAST: tl.constexpr):
    """Second launch of the two-launch form: one program per token block."""
    _finish(z_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NZ, n_split, norm_eps, hc_eps, post_mult,
            tl.program_id(0), M, NZP, BT, ITERS, SC, FAST)


def split_fn_bf16(fn: torch.Tensor) -> torch.Tensor:
    """fp32 fn [NZ, K] -> bf16 [3, NZ, K] with hi + mid + lo equal to fn within ~2**-24 relative."""
    f = fn.float()
    hi = f.to(torch.bfloat16)
    rest = f - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo]).contiguous()


# Forms measured and deleted: a wide split reduce ([sc, tokens, ...] blocks over all of a program's threads):
# 15.8-18.5 us at T=64 (session 3). Loading all 40 split partials at once (sc=64) made the mixing launch 6.0 us
# against 5.0 (session 4). The [tokens, 4, 4] block Sinkhorn (two shuffles per step; kept for M != 4): mixing
# launch 4.6 us against 3.5 per-token (session 5). ONE launch (session 5, with the per-token Sinkhorn and
# loop-carried partial sums): 12.9 / 12.5 us at T=64 against 12.8 for two launches, 19.0 against 18.0 at
# T=256 (H200 rounds 1-2): the ticket and the last program's serial tail cost what the second launch did.
# Hardware reciprocals in the Sinkhorn loop (compiled kernels; the interpreter divides).
FAST_RCP_DEFAULT = True
# The first pass loads the next step's r and fn tiles before this step's products. H200 session 4 round 1
# (T=64): first pass 8.4 us against 9.2, both launches 13.9 against 14.7.
PREFETCH_DEFAULT = True


def _precision() -> str:
    # fp32 products matter here (z feeds sigmoids and a 20-step Sinkhorn), so "ieee" (plain FMAs) when r is fp32.
    # Measured on an H200 (T=64/256/4096, H=5120): 43/115/1003 us with "ieee" against 218/540/7197 us with
    # "tf32x3"; the FMA dot is arithmetic-bound (~5 TFLOP/s). bf16 residuals take the bf16x3 path instead.
    return "ieee"


def hc_mixes_triton(residual, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20, post_mult=2.0,
                    block_t: int | None = None, block_k: int | None = None, split: int | None = None,
                    only_partial: bool = False, precision: str | None = None, fn_parts: torch.Tensor | None = None,
                    num_warps: int | None = None, sc: int = 16, mix_bt: int = 2, mix_warps: int = 1,
                    num_stages: int | None = None, prefetch: bool | None = None,
                    fast_rcp: bool | None = None) -> HcMixes:
    """precision: None picks "bf16x3" for bf16 residuals (three bf16 tensor-core products against a hi/mid/lo
    split of fn made in registers from the fp32 fn; with fn_parts = split_fn_bf16(fn) given, the parts are read
    instead) and "ieee" otherwise; "ieee"/"tf32x3"/"tf32" force the one-dot fp32 path. None for block_t/
    block_k/split/num_warps picks the per-path defaults below; sc: split partials loaded at once by the mixing
    launch; mix_bt / mix_warps: tokens and warps per program of the mixing launch; prefetch (None: PREFETCH_DEFAULT): the first pass loads a step ahead; fast_rcp (None: FAST_RCP_DEFAULT):
    rcp.approx in the Sinkhorn loop."""
    _check(residual, fn, base, scale)
    T, M, H = residual.shape
    check(M & (M - 1) == 0, f"the Triton path needs a power-of-two stream count, got {M}")
    check(iters >= 1, f"sinkhorn iterations must be >= 1, got {iters}")
    check(sc & (sc - 1) == 0 and mix_bt & (mix_bt - 1) == 0, f"sc and mix_bt must be powers of two ({sc}, {mix_bt})")
    K, NZ = M * H, (2 + M) * M
    NZP = max(16, triton.next_power_of_2(NZ + 1))       # column NZ carries the sum of squares
    if precision is None:
        precision = "bf16x3" if residual.dtype == torch.bfloat16 else _precision()
    split_fn = precision == "bf16x3"
    check(not split_fn or residual.dtype == torch.bfloat16, "precision bf16x3 needs a bf16 residual")
    if split_fn:
        # bf16x3: 16-token blocks at decode sizes, 64 at prefill sizes (fewer re-reads of fn). Up to 128 tokens
        # 256-wide splits in 128-wide steps (2 loop steps per program, 320 programs at T=64): H200 first pass
        # 5.9 us against 7.9 for 512-wide splits in 64-wide steps (session 4 round 3; the per-program loop is
        # latency-bound), which stay the default at 129-256 tokens
        small = T <= 128
        block_t = block_t or (16 if T <= 256 else 64)
        block_k = block_k or (128 if small else 64)
        split = split or (256 if small else 512 if T <= 256 else 2048)
    else:
        # fp32 FMA dot: D's best in the H200 sweep (32-token blocks, 512-wide splits, block_k 128); 64-token
        # blocks spilled ~9 KB per thread and ran 50x slower
        block_t = block_t or 32
        split = split or 512
        block_k = block_k or 128
    split = min(split, max(block_k, triton.next_power_of_2(K)))
    block_k = min(block_k, split)
    n_split = triton.cdiv(K, split)
    n_tb = triton.cdiv(T, block_t)
    dev = residual.device
    r = residual.reshape(T, K).contiguous()
    z = empty((n_split, T, NZP), torch.float32, dev)
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
    pf = (PREFETCH_DEFAULT if prefetch is None else prefetch) and mode != 2 and split // block_k > 1
    _hc_partial_kernel[(n_tb, n_split)](r, w, z, T, K, NZ, BT=block_t, NZP=NZP, BK=block_k, SPLIT=split, MODE=mode,
                                        PRECISION="ieee" if split_fn else precision, UPCAST=INTERPRETING, PF=pf,
                                        num_warps=num_warps or (8 if block_t >= (32 if split_fn else 64) else 4),
                                        **({} if num_stages is None else dict(num_stages=num_stages)))
    if only_partial:            # (benchmark: time the streaming pass alone)
        return None
    _hc_mix_kernel[(triton.cdiv(T, mix_bt),)](z, base, scale, pre, post, comb, T, K, NZ, n_split, norm_eps, hc_eps,
                                              post_mult, M=M, NZP=NZP, BT=mix_bt, ITERS=iters, SC=sc, FAST=fast,
                                              num_warps=mix_warps)
    return HcMixes(pre, post, comb)


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
    """(pre, post, comb) mixes of one mHC sub-layer for every token (module docstring). On CUDA: two launches;
    with a bf16 residual fn's bf16 hi/mid/lo split is made in registers at decode sizes (fn read at 4 bytes),
    and read as cached parts (3 bf16 copies of fn, ~3 MB per sub-layer for V4.1) above 256 tokens."""
    if use_triton(residual):
        # prefill sizes (T > 256): the bf16 parts of fn read from memory (cached per fn tensor), since splitting
        # fn in registers in every 64-token block made the T=4096 pass arithmetic-bound (169 us against the
        # first session's 152 us with the parts); decode sizes split in registers (fewer bytes, no copies)
        big = residual.dtype == torch.bfloat16 and residual.shape[0] > 256
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


def hc_post_torch(R, y, post, comb, next_pre=None):
    """R'[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * R[t, j] (fp32 math, R's dtype out); with next_pre
    also (R', hc_pre_torch(R', next_pre))."""
    _check_apply(R, y, post, comb, next_pre)
    out = (post.float().unsqueeze(-1) * y.float().unsqueeze(-2) +
           torch.matmul(comb.float().transpose(-1, -2), R.float())).to(R.dtype)
    return out if next_pre is None else (out, hc_pre_torch(out, next_pre))


def _check_apply(R, y=None, post=None, comb=None, a=None, triton_path=False):
    check(R.dim() == 3, f"residual must be [tokens, streams, hidden], got {tuple(R.shape)}")
    T, M, H = R.shape
    check(not triton_path or M & (M - 1) == 0, f"the Triton path needs a power-of-two stream count, got {M}")
    if y is not None:
        check(y.shape == (T, H), f"sub-layer output must be [{T}, {H}], got {tuple(y.shape)}")
        check(post.shape == (T, M), f"post mix must be [{T}, {M}], got {tuple(post.shape)}")
        check(comb.shape == (T, M, M), f"comb mix must be [{T}, {M}, {M}], got {tuple(comb.shape)}")
    if a is not None:
        check(a.shape == (T, M), f"pre mix must be [{T}, {M}], got {tuple(a.shape)}")


@triton.jit
def _hc_pre_kernel(r_ptr, a_ptr, x_ptr, H, M: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    j = tl.arange(0, M)
    r = tl.load(r_ptr + (t * M + j[:, None]) * H + h[None, :], mask=h[None, :] < H, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t * M + j)
    tl.store(x_ptr + t * H + h, tl.sum(a[:, None] * r, 0).to(x_ptr.dtype.element_ty), mask=h < H)


@triton.jit
def _hc_post_kernel(r_ptr, y_ptr, post_ptr, comb_ptr, a_ptr, out_ptr, x_ptr, H, M: tl.constexpr, BH: tl.constexpr,
                    PRE: tl.constexpr):
    """Program (token, hidden block): R'[k] = post[k] y + sum_j comb[j, k] R[j]; PRE: also x = sum_k a[k] R'[k]
    from the rounded R' (what a separate read-out would see)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    j = tl.arange(0, M)
    r = tl.load(r_ptr + (t * M + j[:, None]) * H + h[None, :], mask=hm[None, :], other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * H + h, mask=hm, other=0.0).to(tl.float32)
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
                                                         num_warps=4)
    return x


def hc_post_triton(R, y, post, comb, next_pre=None, block_h=256, num_warps=2):
    """block_h / num_warps: H200 round 2 (T=64 / 256): 256 / 2 warps 3.9 / 10.1 us, 512 / 4: 4.3 / 10.9 us."""
    _check_apply(R, y, post, comb, next_pre, triton_path=True)
    T, M, H = R.shape
    R = R.contiguous()
    out = empty((T, M, H), R.dtype, R.device)
    x = empty((T, H), R.dtype, R.device) if next_pre is not None else out
    a = next_pre.float().contiguous() if next_pre is not None else post
    bh = block_h or _block_h(H)
    if T:
        _hc_post_kernel[(T, triton.cdiv(H, bh))](R, y.contiguous(), post.float().contiguous(),
                                                 comb.float().contiguous(), a, out, x, H, M=M, BH=bh,
                                                 PRE=next_pre is not None, num_warps=num_warps)
    return out if next_pre is None else (out, x)


def hc_pre_apply(R: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Read one hidden [T, H] out of the streams R [T, M, H] with the weights a [T, M] (one launch on CUDA)."""
    return hc_pre_triton(R, a) if use_triton(R) else hc_pre_torch(R, a)


def hc_post_apply(R, y, post, comb, next_pre=None):
    """R' = post * y + comb^T R per token (one launch on CUDA); next_pre [T, M]: also return the read-out of
    R' with those weights, (R', x), from the same pass."""
    return hc_post_triton(R, y, post, comb, next_pre) if use_triton(R) else hc_post_torch(R, y, post, comb, next_pre)
