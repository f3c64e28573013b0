"""The MoE router in one launch: the gate GEMM (optional), V4's sqrt-softplus scores, biased top-k, normalised
weights.

Contract (engine/moe.py `Gate.forward` of a score-routed layer):
    logits  = x @ gate_weight^T, stored in x's dtype         (`gate_route`; `route` takes these logits instead)
    scores  = sqrt(softplus(logits.float()))                 logits [T, E] (any float dtype)
    idx     = the top_k experts of scores + bias             bias fp32 [E] (selection only)
    weights = scores[idx] / (sum of them + 1e-20) * scaling  -> (weights fp32 [T, K], idx int64 [T, K])
The experts of a row come in descending order of scores + bias, ties to the lower expert id (torch.topk's order
is unspecified; the expert kernel sums the K products whatever the order).

Why: in the decode step the router is the gate GEMM (~5 us, a launch's latency for 256 KB) and ~9 launches after
it (cast, softplus, sqrt, bias add, top-k, gather, sum, divide, scale), each 1-6 us for a [T, 64] tensor (R3 of
session 6, mid-size V4.1, batch 8: ~20 us per layer, 0.4 ms per step). `route`: a block of rows per program does
the tail: E values per row in registers, K rounds of max + mask. `gate_route`: the GEMM too, as kernels.skinny's
split-K product tile (H cut into slices, one program each; the row block's last program adds them in order and
runs the tail on the logits rounded as the GEMM library would store them).
Cost: `route` T * E elements read, 2 * T * K written; `gate_route` also E * H weights read once per row block.
Programmatic dependent launch (session 12): `route` waits first; `gate_route` is kernels.skinny's product tile
(its first weight step asked of the L2 before the wait). H200 session 12 (mid-size gate: 64 experts, hidden 2048,
top 6; 16 calls back to back in a CUDA graph; us, PDL off -> on): gate_route at 64 rows 5.59 / 5.60 -> 4.88 / 4.87
(R3, benchmarks/kernels_moe.py's pdl sweep); route at 256 rows 2.50 / 2.48 -> 2.25 / 2.26 (R2, .round script).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import INTERPRETING, check, empty, pdl_kw, pdl_wait, use_triton
from . import skinny
from .skinny import product_tile, split_k


def scores_torch(logits: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E]: sqrt(softplus(logits)), the affinities both the choice and the weights use."""
    return F.softplus(logits.float()).sqrt()


def weights_at(scores: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
    """fp32 [T, K]: the chosen experts' scores normalised to sum 1, times `scaling`."""
    w = scores.gather(1, idx)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling


def route_torch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """The twin (and the CPU path): the contract's formulas with torch ops (~9 launches on a GPU)."""
    scores = scores_torch(logits)
    idx = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False).indices
    return weights_at(scores, idx, scaling), idx


@triton.jit
def _route_rows(x, e, rows, T, E, bias_ptr, w_ptr, idx_ptr, scaling, K: tl.constexpr, KP: tl.constexpr,
                BLOCK_E: tl.constexpr):
    """The contract from the logits on, for a block of rows: x fp32 [BM, BLOCK_E] (the logits of rows `rows`,
    experts e), weights and ids stored for the rows < T."""
    ok = e < E
    # softplus = max(x, 0) + log(1 + exp(-|x|)), the log by its series where exp(-|x|) is tiny (fp32 log(1 + u)
    # would lose u's digits), then the square root
    u = tl.exp(-tl.abs(x))
    scores = tl.sqrt(tl.maximum(x, 0.0) + tl.where(u < 1e-3, u * (1.0 - 0.5 * u), tl.log(1.0 + u)))
    key = tl.where(ok[None, :], scores + tl.load(bias_ptr + e, mask=ok, other=0.0)[None, :], float("-inf"))
    kk = tl.arange(0, KP)[None, :]
    ws = tl.zeros((x.shape[0], KP), dtype=tl.float32)
    ids = tl.zeros((x.shape[0], KP), dtype=tl.int32)
    for k in tl.static_range(K):     # K rounds: the best remaining expert (ties: the lower id), then masked out
        best = tl.max(key, axis=1)
        pick = tl.min(tl.where(key == best[:, None], e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == pick[:, None]
        ws = tl.where(kk == k, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], ws)
        ids = tl.where(kk == k, pick[:, None], ids)
        key = tl.where(hit, float("-inf"), key)
    at = rows[:, None].to(tl.int64) * K + kk
    m = (rows < T)[:, None] & (kk < K)
    tl.store(w_ptr + at, ws / (tl.sum(ws, axis=1)[:, None] + 1e-20) * scaling, mask=m)
    tl.store(idx_ptr + at, ids.to(tl.int64), mask=m)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, T, E, row_stride, scaling, K: tl.constexpr,
                  KP: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.arange(0, BLOCK_E)
    pdl_wait(PDL)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * row_stride + e[None, :],
                mask=(rows < T)[:, None] & (e < E)[None, :], other=0.0).to(tl.float32)
    _route_rows(x, e, rows, T, E, bias_ptr, w_ptr, idx_ptr, scaling, K, KP, BLOCK_E)


@triton.jit
def _gate_route_kernel(x_ptr, gw_ptr, bias_ptr, w_ptr, idx_ptr, part_ptr, ticket_ptr, T, E, H, x_stride, k_split,
                       scaling, K: tl.constexpr, KP: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
                       BM: tl.constexpr, BLOCK_E: tl.constexpr, BK: tl.constexpr, PF: tl.constexpr,
                       PDL: tl.constexpr = False):
    acc, _, last, rows, e, _ = product_tile(x_ptr, gw_ptr, gw_ptr, part_ptr, ticket_ptr, T, E, H, x_stride, k_split,
                                            False, UPCAST, SPLIT, BM, BLOCK_E, BK, PDL, PF)
    if last:         # the logits rounded to x's dtype, as the GEMM library stores them, then the tail
        _route_rows(acc.to(x_ptr.dtype.element_ty).to(tl.float32), e, rows, T, E, bias_ptr, w_ptr, idx_ptr,
                    scaling, K, KP, BLOCK_E)


def _check_bias(bias: torch.Tensor, E: int, top_k: int) -> None:
    check(bias.shape == (E,) and bias.dtype == torch.float32, f"route: bias {bias.dtype} {tuple(bias.shape)} for "
          f"{E} experts (want fp32 [{E}])")
    check(0 < top_k <= E <= 4096, f"route: top {top_k} of {E} experts (at most 4096)")


def route_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """The kernel: same contract as `route_torch` (rows read at their stride)."""
    check(logits.dim() == 2, f"route: logits of shape {tuple(logits.shape)} (want [T, E])")
    T, E = logits.shape
    _check_bias(bias, E, top_k)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    w = empty((T, top_k), torch.float32, logits.device)
    idx = empty((T, top_k), torch.int64, logits.device)
    if T:
        BE = triton.next_power_of_2(E)
        BM = max(1, min(16, 2048 // BE, triton.next_power_of_2(T)))
        _route_kernel[(triton.cdiv(T, BM),)](x, bias.contiguous(), w, idx, T, E, x.stride(0), float(scaling),
                                             K=top_k, KP=triton.next_power_of_2(top_k), BM=BM, BLOCK_E=BE,
                                             num_warps=1 if BM * BE <= 256 else 4, **pdl_kw())
    return w, idx


def gate_route_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """The twin of `gate_route_triton` (and the CPU path): the gate GEMM, then `route_torch`."""
    return route_torch(F.linear(x, weight), bias, top_k, scaling)


# experts up to which the gate GEMM runs inside the router kernel (its [rows, experts] tile lives in registers)
GATE_MAX_EXPERTS = 256


def gate_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                      config: dict | None = None):
    """The gate GEMM x [T, H] @ weight [E, H]^T and the contract's tail in one launch: kernels.skinny's split-K
    product tile (K = H cut into SPLIT slices; the last slice's program of a row block adds them in order and runs
    the tail on the logits rounded to x's dtype, as the GEMM library would store them). config: BM (rows per block,
    default 16), BK, SPLIT, PF."""
    check(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype,
          f"gate_route: x {x.dtype} {tuple(x.shape)} with gate weight {weight.dtype} {tuple(weight.shape)}")
    T, H = x.shape
    E = weight.shape[0]
    _check_bias(bias, E, top_k)
    check(E <= GATE_MAX_EXPERTS, f"gate_route: {E} experts (at most {GATE_MAX_EXPERTS} in one tile)")
    xs = x if x.stride(1) == 1 else x.contiguous()
    w = empty((T, top_k), torch.float32, x.device)
    idx = empty((T, top_k), torch.int64, x.device)
    if T == 0:
        return w, idx
    BE = max(16, triton.next_power_of_2(E))
    # (row blocks of 16: FUSED_MAX_ROWS says why; PF: kernels.skinny.product_tile's prefetch before the PDL wait)
    cfg = {"BM": 16, "BK": 128, "PF": skinny.prefetch_on(), **(config or {})}
    cfg.setdefault("SPLIT", max(1, min(16, H // (2 * cfg["BK"]))))
    m_tiles = triton.cdiv(T, cfg["BM"])
    k_split, split, tk = split_k(H, cfg["BK"], cfg["SPLIT"], m_tiles, x.device, site="router")
    part = w
    if split > 1:
        part = empty((2 * split - 1, T, E), torch.float32, x.device)
    _gate_route_kernel[(1, 1, m_tiles * split)](xs, weight.contiguous(), bias.contiguous(), w, idx, part,
                                                w if tk is None else tk, T, E, H, xs.stride(0), k_split,
                                                float(scaling), K=top_k,
                                                KP=triton.next_power_of_2(top_k), UPCAST=INTERPRETING, SPLIT=split,
                                                BM=cfg["BM"], BLOCK_E=BE, BK=cfg["BK"], PF=cfg["PF"], num_warps=4,
                                                num_stages=3, **pdl_kw())
    return w, idx


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(logits):
        return route_triton(logits, bias, top_k, scaling)
    return route_torch(logits, bias, top_k, scaling)


# rows up to which `gate_route` runs the GEMM inside the kernel, in row blocks of 16. H200, mid-size V4.1 gate (64
# experts, hidden 2048, top 6; us at 8 / 16 / 32 / 64 rows), session 9 R1: one launch in row blocks of 16 5.4 / 5.5 /
# 5.7 / 5.8 (the same bits as one block), in one block of all rows 5.5 / 5.6 / 8.8 / 10.9 (one program's tail over
# 64 rows is the longer part), the GEMM library + `route`'s kernel 7.2 / 7.5 / 7.8 / 8.0, the GEMM + the torch tail
# 25.6 / 25.9 / 27.2 / 28.4. Session 13 R3 (PDL on): 256 rows too (16 row blocks x 8 slices, one wave of 128
# programs): 16 calls back to back (benchmarks/kernels_moe.py bench_router) at 64 / 128 / 256 rows 4.8 / 4.9 / 5.1
# against the GEMM library + `route`'s kernel 7.0 / 7.6 / 7.6; the router + the packed-FP4 routed chain (20 layers
# in a CUDA graph, K3's .round script) at 128 / 256 rows 108.1-108.5 / 149.2-150.5 against 110.7-111.7 /
# 151.6-151.7 us a layer
FUSED_MAX_ROWS = 256


def gate_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """Dispatch: on CUDA the one-launch kernel up to FUSED_MAX_ROWS rows of at most GATE_MAX_EXPERTS experts of a
    16-bit dtype (an fp32 dot on the GPU runs in tf32: session 8 R3 saw its routes differ), else the GEMM then
    `route` (its kernel on CUDA, the twin elsewhere)."""
    if (use_triton(x) and x.dim() == 2 and x.shape[0] <= FUSED_MAX_ROWS and weight.shape[0] <= GATE_MAX_EXPERTS
            and x.dtype in (torch.bfloat16, torch.float16)):
        return gate_route_triton(x, weight, bias, top_k, scaling)
    return route(F.linear(x, weight), bias, top_k, scaling)
