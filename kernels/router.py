"""The MoE router after its GEMM, in one launch: V4's sqrt-softplus scores, biased top-k, normalised weights.

Contract (engine/moe.py `Gate.forward` of a score-routed layer, from the logits on):
    scores  = sqrt(softplus(logits.float()))                 logits [T, E] (the gate GEMM's output, any float dtype)
    idx     = the top_k experts of scores + bias             bias fp32 [E] (selection only)
    weights = scores[idx] / (sum of them + 1e-20) * scaling  -> (weights fp32 [T, K], idx int64 [T, K])
The experts of a row come in descending order of scores + bias, ties to the lower expert id (torch.topk's order
is unspecified; the expert kernel sums the K products whatever the order).

Why: in the decode step the router is ~9 launches per layer after its GEMM (cast, softplus, sqrt, bias add, top-k,
gather, sum, divide, scale), each 1-6 us for a [T, 64] tensor (R3 of session 6, mid-size V4.1, batch 8: ~20 us per
layer, 0.4 ms per step). One program per row does them all: E values in registers, K rounds of max + mask.
Cost: T * E elements read, 2 * T * K written; E up to 4,096 per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import check, empty, use_triton


def route_torch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """The twin (and the CPU path): the contract's formulas with torch ops."""
    scores = F.softplus(logits.float()).sqrt()
    idx = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, idx


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, E, row_stride, scaling, K: tl.constexpr,
                  KP: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + row * row_stride + e, mask=ok, other=0.0).to(tl.float32)
    # softplus = max(x, 0) + log(1 + exp(-|x|)), the log by its series where exp(-|x|) is tiny (fp32 log(1 + u)
    # would lose u's digits), then the square root
    u = tl.exp(-tl.abs(x))
    scores = tl.sqrt(tl.maximum(x, 0.0) + tl.where(u < 1e-3, u * (1.0 - 0.5 * u), tl.log(1.0 + u)))
    key = tl.where(ok, scores + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
    kk = tl.arange(0, KP)
    ws = tl.zeros((KP,), dtype=tl.float32)
    ids = tl.zeros((KP,), dtype=tl.int32)
    for k in tl.static_range(K):     # K rounds: the best remaining expert (ties: the lower id), then masked out
        best = tl.max(key, axis=0)
        pick = tl.min(tl.where(key == best, e, BLOCK_E), axis=0)
        ws = tl.where(kk == k, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), ws)
        ids = tl.where(kk == k, pick, ids)
        key = tl.where(e == pick, float("-inf"), key)
    tl.store(w_ptr + row * K + kk, ws / (tl.sum(ws, axis=0) + 1e-20) * scaling, mask=kk < K)
    tl.store(idx_ptr + row * K + kk, ids.to(tl.int64), mask=kk < K)


def route_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """The kernel: same contract as `route_torch` (rows read at their stride)."""
    check(logits.dim() == 2, f"route: logits of shape {tuple(logits.shape)} (want [T, E])")
    T, E = logits.shape
    check(bias.shape == (E,) and bias.dtype == torch.float32, f"route: bias {bias.dtype} {tuple(bias.shape)} for "
          f"{E} experts (want fp32 [{E}])")
    check(0 < top_k <= E <= 4096, f"route: top {top_k} of {E} experts (at most 4096)")
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    w = empty((T, top_k), torch.float32, logits.device)
    idx = empty((T, top_k), torch.int64, logits.device)
    if T:
        _route_kernel[(T,)](x, bias.contiguous(), w, idx, E, x.stride(0), float(scaling), K=top_k,
                            KP=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                            num_warps=1 if E <= 256 else 4)
    return w, idx


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(logits):
        return route_triton(logits, bias, top_k, scaling)
    return route_torch(logits, bias, top_k, scaling)
