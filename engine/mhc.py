"""Manifold-constrained hyper-connections (mHC): M residual streams mixed around every sub-layer.

For a sub-layer with parameters (fn [(2+M)M, M*H], base [(2+M)M], scale [3]) the residual R [T, M, H] gives
  pre  [T, M]    (how to read the sub-layer input out of the streams),
  post [T, M]    (how to write the sub-layer output into the streams),
  comb [T, M, M] (doubly-stochastic stream mixing, Sinkhorn-projected; comb[j, k]: source j -> destination k).
All in fp32. Cost per token: one (M*H x (2+M)M) matvec plus O(iters * M^2).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import streams
from .norm import rms_normalize

# The write-back + mixes launch's mixing tail (the partials' reduction and the Sinkhorn: nothing reads the mixes
# before the sub-layer after the write-back) deferred to a launch of its own on the "mhc" side stream, beside that
# sub-layer (kernels.hc_mix.hc_post_mix_triton's defer). _PENDING: (side stream, its HcMixes: the buffers kept
# alive) not yet joined; every consumer of mixes here (hc_pre, hc_post, hc_post_and_mixes) joins them first, a
# graph segment joins any left before it returns (batched.span: a capture must not end with the side stream
# unjoined) and a failed step drops them (Model.launch, `drop_mixes`).
DEFER_MIXES = True
_PENDING: list = []


def join_mixes() -> None:
    """Wait (in stream order) for the mixes deferred to the side stream so far."""
    while _PENDING:
        streams.join(_PENDING.pop()[0])


def drop_mixes() -> None:
    """A failed step's deferred mixes: joined (their buffers are not reused while the side stream may still write
    them) and forgotten even when a join fails (the next step must not join them, inside its own capture)."""
    try:
        join_mixes()
    finally:
        _PENDING.clear()


def hc_mixes(R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
             hc_eps: float, iters: int, post_mult: float = 2.0):
    T, M, H = R.shape
    flat = rms_normalize(R.reshape(T, M * H).float(), eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([M, M, M * M], dim=-1)
    pre_b, post_b, comb_b = base.float().split([M, M, M * M])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = post_mult * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(T, M, M) * s[2] + comb_b.view(M, M), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_pre(R: torch.Tensor, pre: torch.Tensor, fast: bool = False) -> torch.Tensor:
    """Read one hidden [T, H] out of the streams: sum_j pre[:, j] * R[:, j] (fp32 math, R's dtype out).
    fast: deepinfer_sg.kernels.hc_mix.hc_pre_apply (one Triton launch on CUDA instead of 3; same math); else its
    twin hc_pre_torch."""
    from deepinfer_sg.kernels.hc_mix import hc_pre_apply, hc_pre_torch
    join_mixes()
    return hc_pre_apply(R, pre) if fast else hc_pre_torch(R, pre)


def hc_post(R: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fast: bool = False,
            next_pre: torch.Tensor | None = None, y2: torch.Tensor | None = None):
    """R'[:, k] = post[:, k] * y + sum_j comb[:, j, k] * R[:, j]  (fp32 math, stored in R's dtype).
    next_pre [T, M]: return (R', hc_pre(R', next_pre)), the next sub-layer's read-out (shifted mHC knows it).
    y2: a second addend of y, summed with it in fp32 (MoE.forward_grouped(parts=True)'s shared expert output:
    no add launch, one rounding). fast: deepinfer_sg.kernels.hc_mix.hc_post_apply (one Triton launch on CUDA,
    read-out included, instead of ~6 + 3; same math up to fp32 summation order)."""
    join_mixes()
    if fast:
        from deepinfer_sg.kernels.hc_mix import hc_post_apply
        return hc_post_apply(R, y, post, comb, next_pre, y2)
    from deepinfer_sg.kernels.hc_mix import hc_post_torch
    return hc_post_torch(R, y, post, comb, next_pre, y2)


class ReadOut(NamedTuple):
    """A write-back's read-out x together with the mixes (pre, post, comb) of the sub-layer after it, computed by
    the same pass (hc_post_and_mixes) from the R' it wrote. x is the read-out already RMSNorm-ed by the sub-layer's
    input norm (hc_post_and_mixes(norm=...)): batched.pre_attention takes it as the norm's output."""
    x: torch.Tensor
    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


def hc_post_and_mixes(block, which: str, R: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      next_pre: torch.Tensor, y2: torch.Tensor | None = None, norm=None) -> ReadOut:
    """R' = hc_post(R, y, post, comb, y2=y2), its read-out with next_pre, and the mixes of `block`'s sub-layer
    `which` ("attn" / "ffn") of R': (R', ReadOut(x, pre, post, comb)). One launch on CUDA instead of two
    (deepinfer_sg.kernels.hc_mix.hc_post_mix_apply: R' is not read back); elsewhere exactly hc_post(fast=True)
    followed by block.mixes(R', which, fast=True). norm (the next sub-layer's input RMSNorm module): x is then
    norm(x), normalised in the same launch on CUDA where it fits (hc_post_mix_apply's x_norm), else by norm.
    DEFER_MIXES: the mixes' tail as its own launch on a side stream (joined by the next consumer, _PENDING)."""
    from deepinfer_sg.kernels.hc_mix import hc_post_mix_apply
    join_mixes()
    c = block.config
    out, x, m = hc_post_mix_apply(R, y, post, comb, next_pre, getattr(block, f"hc_{which}_fn"),
                                  getattr(block, f"hc_{which}_base"), getattr(block, f"hc_{which}_scale"),
                                  norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps, iters=c.hc_sinkhorn_iters,
                                  post_mult=c.hc_post_mult, y2=y2,
                                  x_norm=None if norm is None else (norm.weight_fp32(), norm.eps), defer=DEFER_MIXES)
    if m.finish is not None:
        side = streams.fork(out, lane="mhc")
        with streams.on(side):
            m.finish()
        if side is not None:
            _PENDING.append((side, m))
    return out, ReadOut(x, m.pre, m.post, m.comb)


def hc_head_collapse(R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
                     hc_eps: float) -> torch.Tensor:
    """V4's final collapse (non-shifted schedule): its own pre-mix from `hc_head_{fn,base,scale}`."""
    T, M, H = R.shape
    flat = rms_normalize(R.reshape(T, M * H).float(), eps)
    mix = F.linear(flat, fn.float())
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * R).sum(dim=1).to(R.dtype)
