"""Manifold-constrained hyper-connection mixes (V4.1 mHC, architecture doc section 2.2), fused.

From the M residual streams R [T, M, H] of each token and a sub-layer's parameters fn [(2+M)*M, M*H],
base [(2+M)*M], scale [3] (all fp32; the RMSNorm weight is already folded into fn's columns):
  r    = flatten(R) in fp32;  z = (r @ fn^T) * rsqrt(mean(r^2) + norm_eps)
  pre  = sigmoid(z[:M] * scale[0] + base[:M]) + hc_eps                       [T, M]
  post = sigmoid(z[M:2M] * scale[1] + base[M:2M]) * post_mult                [T, M]
  C    = softmax_rows(z[2M:] * scale[2] + base[2M:] as [M, M]) + hc_eps, then a column normalisation,
         then (iters - 1) x (row normalisation, column normalisation); each divides by (sum + hc_eps)   [T, M, M]
C[j, k] mixes source stream j into destination stream k.

Triton: pass 1 reads R once (split over the M*H dimension: grid token blocks x splits, enough programs at
decode batch sizes) and writes partial z and sum of squares per split; pass 2 (one program per token block)
adds the partials in a fixed order and does the sigmoid/softmax/Sinkhorn arithmetic in registers.
Cost: T*M*H*bytes(R) + |fn| (fn stays in L2); the mix arithmetic is negligible. The product r . fn^T needs fp32
accuracy: fp32 residuals use Triton's "ieee" dot (FMAs: D measured it arithmetic-bound, 1-3% of bandwidth on an
H200); bf16 residuals (the model's) use three bf16 tensor-core products against a hi/mid/lo bf16 split of fn.
"""
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import INTERPRETING, check, empty, use_triton


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
def _hc_partial_kernel(r_ptr, fn_ptr, z_ptr, sq_ptr, T, K, NZ, BT: tl.constexpr, NZP: tl.constexpr,
                       BK: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, SPLIT_FN: tl.constexpr,
                       UPCAST: tl.constexpr):
    """Program (token block, split of M*H): partial z = r . fn and sum of r^2 over the split's columns.
    SPLIT_FN: fn comes as three bf16 parts (hi + mid + lo == fn to ~2**-24) and r is bf16, so three bf16 tensor-
    core products with fp32 accumulation give fp32-accurate z (bf16 x bf16 products are exact in fp32).
    UPCAST: the interpreter computes bf16 dots wrongly, so it takes them in fp32 (same exact products)."""
    tb = tl.program_id(0)
    sp = tl.program_id(1)
    toks = tb * BT + tl.arange(0, BT)
    zs = tl.arange(0, NZP)
    acc = tl.zeros([BT, NZP], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    for i in range(0, SPLIT // BK):          # a loop, not unrolled: unrolling hoisted every load and spilled
        ks = sp * SPLIT + i * BK + tl.arange(0, BK)
        rmask = (toks[:, None] < T) & (ks[None, :] < K)
        wmask = (zs[:, None] < NZ) & (ks[None, :] < K)
        r = tl.load(r_ptr + toks[:, None].to(tl.int64) * K + ks[None, :], mask=rmask, other=0.0)
        rf = r.to(tl.float32)
        if SPLIT_FN:
            for part in tl.static_range(3):
                w = tl.load(fn_ptr + (part * NZ + zs[:, None]).to(tl.int64) * K + ks[None, :], mask=wmask,
                            other=0.0)
                if UPCAST:
                    acc += tl.dot(rf, tl.trans(w.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(r, tl.trans(w))
        else:
            w = tl.load(fn_ptr + zs[:, None] * K + ks[None, :], mask=wmask, other=0.0)
            acc += tl.dot(rf, tl.trans(w), input_precision=PRECISION)
        sq += tl.sum(rf * rf, 1)
    tl.store(z_ptr + (sp * T + toks[:, None]) * NZP + zs[None, :], acc, mask=toks[:, None] < T)
    tl.store(sq_ptr + sp * T + toks, sq, mask=toks < T)


def split_fn_bf16(fn: torch.Tensor) -> torch.Tensor:
    """fp32 fn [NZ, K] -> bf16 [3, NZ, K] with hi + mid + lo equal to fn within ~2**-24 relative."""
    f = fn.float()
    hi = f.to(torch.bfloat16)
    rest = f - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo]).contiguous()


@triton.jit
def _hc_mix_kernel(z_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, n_split, norm_eps,
                   hc_eps, post_mult, M: tl.constexpr, NZP: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr):
    tb = tl.program_id(0)
    toks = tb * BT + tl.arange(0, BT)
    tok_ok = toks < T
    j = tl.arange(0, M)
    # sum the split partials in a fixed order (deterministic)
    sq = tl.zeros([BT], tl.float32)
    zp = tl.zeros([BT, M], tl.float32)
    zq = tl.zeros([BT, M], tl.float32)
    zc = tl.zeros([BT, M, M], tl.float32)
    for s in range(0, n_split):
        row = (s * T + toks).to(tl.int64) * NZP
        sq += tl.load(sq_ptr + s * T + toks, mask=tok_ok, other=0.0)
        zp += tl.load(z_ptr + row[:, None] + j[None, :], mask=tok_ok[:, None], other=0.0)
        zq += tl.load(z_ptr + row[:, None] + M + j[None, :], mask=tok_ok[:, None], other=0.0)
        zc += tl.load(z_ptr + row[:, None, None] + 2 * M + j[None, :, None] * M + j[None, None, :],
                      mask=tok_ok[:, None, None], other=0.0)
    inv_rms = 1.0 / tl.sqrt(sq / K + norm_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(zp * inv_rms[:, None] * s0 + tl.load(base_ptr + j)[None, :]) + hc_eps
    post = tl.sigmoid(zq * inv_rms[:, None] * s1 + tl.load(base_ptr + M + j)[None, :]) * post_mult
    c = zc * inv_rms[:, None, None] * s2 + tl.load(base_ptr + 2 * M + j[:, None] * M + j[None, :])[None, :, :]
    c = tl.exp(c - tl.max(c, 2)[:, :, None])
    c = c / tl.sum(c, 2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, 2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
    tl.store(pre_ptr + toks[:, None] * M + j[None, :], pre, mask=tok_ok[:, None])
    tl.store(post_ptr + toks[:, None] * M + j[None, :], post, mask=tok_ok[:, None])
    tl.store(comb_ptr + toks[:, None, None] * (M * M) + j[None, :, None] * M + j[None, None, :], c,
             mask=tok_ok[:, None, None])


def _precision() -> str:
    # fp32 products matter here (z feeds sigmoids and a 20-step Sinkhorn), so "ieee" (plain FMAs) when r is fp32.
    # Measured on an H200 (T=64/256/4096, H=5120): 43/115/1003 us with "ieee" against 218/540/7197 us with
    # "tf32x3"; the FMA dot is arithmetic-bound (~5 TFLOP/s). bf16 residuals take the split-fn path instead.
    return "ieee"


def hc_mixes_triton(residual, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20, post_mult=2.0,
                    block_t: int | None = None, block_k: int | None = None, split: int | None = None,
                    only_partial: bool = False, precision: str | None = None, fn_parts: torch.Tensor | None = None,
                    num_warps: int | None = None) -> HcMixes:
    """precision: None picks "bf16x3" for bf16 residuals (three bf16 tensor-core products against a hi/mid/lo
    split of fn: fp32-accurate; fn_parts = split_fn_bf16(fn) can be passed in, computed once per layer) and
    "ieee" otherwise; "ieee"/"tf32x3"/"tf32" force the one-dot fp32 path. None for block_t/block_k/split/num_warps
    picks the per-path defaults below."""
    _check(residual, fn, base, scale)
    T, M, H = residual.shape
    check(M & (M - 1) == 0, f"the Triton path needs a power-of-two stream count, got {M}")
    check(iters >= 1, f"sinkhorn iterations must be >= 1, got {iters}")
    K, NZ = M * H, (2 + M) * M
    NZP = max(16, triton.next_power_of_2(NZ))
    if precision is None:
        precision = "bf16x3" if residual.dtype == torch.bfloat16 else _precision()
    split_fn = precision == "bf16x3"
    check(not split_fn or residual.dtype == torch.bfloat16, "precision bf16x3 needs a bf16 residual")
    if split_fn:
        # bf16x3: 16-token blocks at decode sizes, 64 at prefill sizes (fewer re-reads of fn); few splits, since the
        # mix kernel adds the split partials one after another and the bytes are few (T=64: 2.6 MB of residual).
        # These tiles build for sm_90 without spills (block_k 64; 8 warps with 64-token blocks).
        block_t = block_t or (16 if T <= 256 else 64)
        block_k = block_k or 64
        split = split or 2048
    else:
        # fp32 FMA dot: D's best in the H200 sweep (32-token blocks, 512-wide splits, block_k 128); 64-token
        # blocks spilled ~9 KB per thread and ran 50x slower
        block_t = block_t or 32
        split = split or 512
        block_k = block_k or 128
    split = min(split, max(block_k, triton.next_power_of_2(K)))
    block_k = min(block_k, split)
    n_split = triton.cdiv(K, split)
    dev = residual.device
    r = residual.reshape(T, K).contiguous()
    z = empty((n_split, T, NZP), torch.float32, dev)
    sq = empty((n_split, T), torch.float32, dev)
    if split_fn:
        w = split_fn_bf16(fn) if fn_parts is None else fn_parts
    else:
        w = fn.float().contiguous()
    _hc_partial_kernel[(triton.cdiv(T, block_t), n_split)](r, w, z, sq, T, K, NZ, BT=block_t, NZP=NZP, BK=block_k,
                                                           SPLIT=split, num_warps=num_warps or (8 if block_t >= 64 else 4),
                                                           PRECISION="ieee" if split_fn else precision,
                                                           SPLIT_FN=split_fn, UPCAST=INTERPRETING)
    if only_partial:            # (benchmark: time the streaming pass alone)
        return None
    pre = empty((T, M), torch.float32, dev)
    post = empty((T, M), torch.float32, dev)
    comb = empty((T, M, M), torch.float32, dev)
    bt2 = 16
    _hc_mix_kernel[(triton.cdiv(T, bt2),)](z, sq, base.float().contiguous(), scale.float().contiguous(), pre, post,
                                           comb, T, K, n_split, norm_eps, hc_eps, post_mult, M=M, NZP=NZP, BT=bt2,
                                           ITERS=iters, num_warps=4)
    return HcMixes(pre, post, comb)


_PARTS: dict = {}      # id(fn) -> (weakref to fn, fn._version, bf16 parts): the split is made once per weight


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
    """(pre, post, comb) mixes of one mHC sub-layer for every token (module docstring). On CUDA with a bf16
    residual the bf16 split of fn is cached per fn tensor (3 x bf16 copies of fn: ~3 MB per sub-layer for V4)."""
    if use_triton(residual):
        parts = fn_parts_cached(fn) if residual.dtype == torch.bfloat16 else None
        return hc_mixes_triton(residual, fn, base, scale, norm_eps, hc_eps, iters, post_mult, fn_parts=parts)
    return hc_mixes_torch(residual, fn, base, scale, norm_eps, hc_eps, iters, post_mult)
