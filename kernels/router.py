"""The MoE router in one launch: the gate GEMM (optional), V4's sqrt-softplus scores, biased top-k, normalised
weights.

Contract (engine/moe.py `Gate.forward` of a score-routed layer):
    logits  = x @ gate_weight^T, stored in x's dtype         (`gate_route`; `route` takes these logits instead)
    scores  = sqrt(softplus(logits.float()))                 logits [T, E] (any float dtype)
    idx     = the top_k experts of scores + bias             bias fp32 [E], finite (selection only)
    weights = scores[idx] / (sum of them + 1e-20) * scaling  -> (weights fp32 [T, K], idx int64 [T, K])
The experts of a row come in descending order of scores + bias, ties to the lower expert id (torch.topk's order
is unspecified; the expert kernel sums the K products whatever the order).

Why: in the decode step the router is the gate GEMM (~5 us, a launch's latency for 256 KB) and ~9 launches after
it (cast, softplus, sqrt, bias add, top-k, gather, sum, divide, scale), each 1-6 us for a [T, 64] tensor (R3 of
session 6, mid-size V4.1, batch 8: ~20 us per layer, 0.4 ms per step). `route`: a block of rows per program does
the tail: E values per row in registers, K rounds of max + mask. `gate_route`: the GEMM too, as kernels.skinny's
split-K product tile (H cut into slices, one program each; the row block's last program adds them in order and
runs the tail on the logits rounded as the GEMM library would store them).
Wider gates (V4.1's 384 experts, above 256 16-bit experts: `one_tile`) run as expert tiles, each finished tile
picking its own top K into a workspace and the row block's last program picking the K best of those (session 14;
TILED_MAX_ROWS has the numbers).
Cost: `route` T * E elements read, 2 * T * K written; `gate_route` also E * H weights read once per row block.
Programmatic dependent launch (session 12): `route` waits first; `gate_route` is kernels.skinny's product tile
(its first weight step asked of the L2 before the wait). H200 session 12 (mid-size gate: 64 experts, hidden 2048,
top 6; 16 calls back to back in a CUDA graph; us, PDL off -> on): gate_route at 64 rows 5.59 / 5.60 -> 4.88 / 4.87
(R3, benchmarks/kernels_moe.py's pdl sweep); route at 256 rows 2.50 / 2.48 -> 2.25 / 2.26 (R2, .round script).
From 257 to 1024 experts `route` runs a row a program in one warp (session 14 R3, V4.1's 384 experts, GEMM library +
`route`, us at 8 / 16 / 32 / 64 / 256 rows: 10.47-11.23 / 11.36-11.40 / 11.32-11.33 / 11.03-11.86 / 13.62-13.66
with 4 rows in 4 warps -> 9.58-10.05 / 10.57-10.61 / 10.59-10.60 / 11.03-11.04 / 12.73-12.83; 2 rows in one warp
12.25-13.03 / 13.28-13.31 / 13.48-13.51 / 14.02-14.26 / 15.68-15.70).
The one-tile gate and `route` keep session 13's code (sm_90 builds the same as HEAD's, checked on SASS): the tiles'
shared top-K helpers in their place compiled the 8-row build to another instruction order, 0.28 us slower at the
mid-size gate (R2, R3: 4.88-4.95 against 5.16-5.24 us).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import INTERPRETING, check, empty, pdl_kw, pdl_wait, tickets, use_triton
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
def _scores_keys(x, e, E, bias_ptr):
    """x fp32 [R, C] logits of experts e [C] -> (scores, keys = scores + bias; -inf at e >= E)."""
    ok = e < E
    # softplus = max(x, 0) + log(1 + exp(-|x|)), the log by its series where exp(-|x|) is tiny (fp32 log(1 + u)
    # would lose u's digits), then the square root
    u = tl.exp(-tl.abs(x))
    scores = tl.sqrt(tl.maximum(x, 0.0) + tl.where(u < 1e-3, u * (1.0 - 0.5 * u), tl.log(1.0 + u)))
    return scores, tl.where(ok[None, :], scores + tl.load(bias_ptr + e, mask=ok, other=0.0)[None, :], float("-inf"))


@triton.jit
def _top_k(key, val, ids, K: tl.constexpr, KP: tl.constexpr, BIG: tl.constexpr):
    """K rounds over [R, C] tiles (ids distinct in a row, below BIG): the best remaining key (ties: the lower id),
    then masked out -> (keys, values, ids) [R, KP] of the K picks in order (columns past K: -inf, 0, 0)."""
    kk = tl.arange(0, KP)[None, :]
    ks = tl.full((key.shape[0], KP), float("-inf"), dtype=tl.float32)
    vs = tl.zeros((key.shape[0], KP), dtype=tl.float32)
    out = tl.zeros((key.shape[0], KP), dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(key, axis=1)
        pick = tl.min(tl.where(key == best[:, None], ids, BIG), axis=1)
        hit = ids == pick[:, None]
        ks = tl.where(kk == k, best[:, None], ks)
        vs = tl.where(kk == k, tl.sum(tl.where(hit, val, 0.0), axis=1)[:, None], vs)
        out = tl.where(kk == k, pick[:, None], out)
        key = tl.where(hit, float("-inf"), key)
    return ks, vs, out


@triton.jit
def _store_route(ws, ids, rows, T, w_ptr, idx_ptr, scaling, K: tl.constexpr, KP: tl.constexpr):
    """The picks' scores ws and ids [R, KP] of rows `rows`: weights normalised and scaled, stored for rows < T."""
    kk = tl.arange(0, KP)[None, :]
    at = rows[:, None].to(tl.int64) * K + kk
    m = (rows < T)[:, None] & (kk < K)
    tl.store(w_ptr + at, ws / (tl.sum(ws, axis=1)[:, None] + 1e-20) * scaling, mask=m)
    tl.store(idx_ptr + at, ids.to(tl.int64), mask=m)


@triton.jit
def _route_rows(x, e, rows, T, E, bias_ptr, w_ptr, idx_ptr, scaling, K: tl.constexpr, KP: tl.constexpr,
                BLOCK_E: tl.constexpr):
    """The contract from the logits on, for a block of rows: x fp32 [BM, BLOCK_E] (the logits of rows `rows`,
    experts e), weights and ids stored for the rows < T."""
    scores, key = _scores_keys(x, e, E, bias_ptr)
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
    """One expert tile: the row block's finishing program runs the tail on the tile it holds."""
    acc, _, last, rows, e, _ = product_tile(x_ptr, gw_ptr, gw_ptr, part_ptr, ticket_ptr, T, E, H, x_stride, k_split,
                                            False, UPCAST, SPLIT, BM, BLOCK_E, BK, PDL, PF)
    if last:         # the logits rounded to x's dtype, as the GEMM library stores them, then the tail
        _route_rows(acc.to(x_ptr.dtype.element_ty).to(tl.float32), e, rows, T, E, bias_ptr, w_ptr, idx_ptr,
                    scaling, K, KP, BLOCK_E)


@triton.jit
def _gate_tiles_kernel(x_ptr, gw_ptr, bias_ptr, w_ptr, idx_ptr, part_ptr, ticket_ptr, cand_ptr, cid_ptr,
                       row_ticket_ptr, T, E, H, x_stride, k_split, scaling, K: tl.constexpr, KP: tl.constexpr,
                       UPCAST: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, NC: tl.constexpr, PF: tl.constexpr, PDL: tl.constexpr = False):
    """Expert tiles (grid dim 0): each finished tile's top K to the workspace; the row block's last merges."""
    acc, _, last, rows, e, _ = product_tile(x_ptr, gw_ptr, gw_ptr, part_ptr, ticket_ptr, T, E, H, x_stride, k_split,
                                            False, UPCAST, SPLIT, BM, BN, BK, PDL, PF)
    if last:
        scores, key = _scores_keys(acc.to(x_ptr.dtype.element_ty).to(tl.float32), e, E, bias_ptr)
        ks, vs, ids = _top_k(key, scores, tl.broadcast_to(e[None, :], key.shape), K, KP, 2147483647)
        at = rows[:, None].to(tl.int64) * NC + tl.program_id(0) * KP + tl.arange(0, KP)[None, :]
        tl.store(cand_ptr + at, ks, mask=(rows < T)[:, None])
        tl.store(cand_ptr + T * NC + at, vs, mask=(rows < T)[:, None])
        tl.store(cid_ptr + at, ids, mask=(rows < T)[:, None])
        tl.debug_barrier()                           # every thread's stores precede the release below
        pm = tl.program_id(2) // SPLIT
        done = tl.atomic_add(row_ticket_ptr + pm, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.debug_barrier()                       # (the acquire above precedes every thread's reads below)
            c = tl.arange(0, NC)[None, :]
            have = (c < tl.num_programs(0) * KP) & (rows < T)[:, None]
            ca = rows[:, None].to(tl.int64) * NC + c
            # a row's candidates hold its K best (each tile's K best by the same order), so their K best are the
            # row's. Candidates of key -inf (padding columns; picks of a tile with fewer than K experts, which
            # may repeat an id) take distinct ids past the experts' and below _top_k's BIG: never picked, as
            # K <= E keys are finite (a finite bias: the contract's)
            ky = tl.load(cand_ptr + ca, mask=have, other=float("-inf"))
            picked = _top_k(ky, tl.load(cand_ptr + T * NC + ca, mask=have, other=0.0),
                            tl.where(ky > float("-inf"), tl.load(cid_ptr + ca, mask=have, other=0), 2147483646 - c),
                            K, KP, 2147483647)
            _store_route(picked[1], picked[2], rows, T, w_ptr, idx_ptr, scaling, K, KP)
            tl.atomic_xchg(row_ticket_ptr + pm, 0, sem="relaxed", scope="gpu")      # ready for the next launch


def _check_bias(bias: torch.Tensor, E: int, top_k: int) -> None:
    check(bias.shape == (E,) and bias.dtype == torch.float32, f"route: bias {bias.dtype} {tuple(bias.shape)} for "
          f"{E} experts (want fp32 [{E}])")
    check(0 < top_k <= E <= 4096, f"route: top {top_k} of {E} experts (at most 4096)")
    # a finite bias is the caller's (engine/moe.py's zeros or the checkpoint's): checking it here would read the
    # device each call, and no read is allowed while a CUDA graph captures. With fewer than K finite keys (a -inf
    # bias) the picks are not the twin's (the one-tile path repeats an id, the tiled merge stores ids past E)


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
        warps = 1 if BM * BE <= 256 else 4
        if 256 < BE <= 1024:   # a row a program in one warp: its K rounds of reductions stay inside the warp
            BM, warps = 1, 1     # (wider rows: 4 warps, as a warp would hold 64+ values a thread in 3 arrays)
        _route_kernel[(triton.cdiv(T, BM),)](x, bias.contiguous(), w, idx, T, E, x.stride(0), float(scaling),
                                             K=top_k, KP=triton.next_power_of_2(top_k), BM=BM, BLOCK_E=BE,
                                             num_warps=warps, **pdl_kw())
    return w, idx


def gate_route_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """The twin of `gate_route_triton` (and the CPU path): the gate GEMM, then `route_torch`."""
    return route_torch(F.linear(x, weight), bias, top_k, scaling)


def one_tile(E: int, elsize: int) -> bool:
    """Whether a gate of E experts (weights of elsize bytes) runs as one expert tile: up to 256 16-bit experts (the
    tail on the [rows, experts] tile in registers), 128 fp32 ones (the weight stages' shared memory)."""
    return max(16, triton.next_power_of_2(E)) * elsize <= 512


def gate_config(H: int, E: int, elsize: int = 2) -> dict:
    """The gate launch's tiles: BM rows a block; BN experts a tile (all of them, padded, when `one_tile`; else
    tiles of 128 16-bit / 64 fp32 experts, in 8 warps: 4 spill); BK, SPLIT slices of H; PF:
    kernels.skinny.product_tile's prefetch before the PDL wait."""
    one = one_tile(E, elsize)
    cfg = {"BM": 16, "BN": max(16, triton.next_power_of_2(E)) if one else 256 // elsize, "BK": 128,
           "PF": skinny.prefetch_on(), "warps": 4 if one else 8}
    cfg["SPLIT"] = max(1, min(16, H // (2 * cfg["BK"])))
    return cfg


def gate_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                      config: dict | None = None):
    """The gate GEMM x [T, H] @ weight [E, H]^T and the contract's tail in one launch: kernels.skinny's split-K
    product tile (H cut into SPLIT slices; a tile's last slice's program adds them in order) over row blocks and
    expert tiles; the logits rounded to x's dtype, as the GEMM library would store them. One expert tile: its
    finishing program runs the tail on the tile it holds. Several: each finished tile picks its own top K (the
    same rule: a row's K best are among its tiles' K best) into a workspace and takes a ticket of its row block;
    the block's last program picks the K best of those candidates. config: `gate_config`'s keys. Without ticket
    counters (a CUDA graph captured before any warm-up made them) the launch runs unsplit, and with several
    expert tiles the GEMM library + `route` run instead."""
    check(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype,
          f"gate_route: x {x.dtype} {tuple(x.shape)} with gate weight {weight.dtype} {tuple(weight.shape)}")
    T, H = x.shape
    E = weight.shape[0]
    _check_bias(bias, E, top_k)
    w = empty((T, top_k), torch.float32, x.device)
    idx = empty((T, top_k), torch.int64, x.device)
    if T == 0:
        return w, idx
    cfg = {**gate_config(H, E, x.element_size()), **(config or {})}
    BE = max(16, triton.next_power_of_2(E))
    BN = min(cfg["BN"], BE)
    KP = triton.next_power_of_2(top_k)
    n_e, m_tiles = triton.cdiv(E, BN), triton.cdiv(T, cfg["BM"])
    tk = tickets(x.device, m_tiles * (n_e + 1), site="router")   # the tiles' split-K tickets, then the row blocks'
    if tk is None and n_e > 1:
        return route(F.linear(x, weight), bias, top_k, scaling)
    k_split, split, _ = split_k(H, cfg["BK"], cfg["SPLIT"] if tk is not None else 1, m_tiles * n_e, x.device,
                                site="router", given=tk)
    part = w
    if split > 1:
        part = empty((2 * split - 1, T, E), torch.float32, x.device)
    xs = x if x.stride(1) == 1 else x.contiguous()
    tk = w if tk is None else tk
    args = (xs, weight.contiguous(), bias.contiguous(), w, idx, part, tk)
    common = dict(K=top_k, KP=KP, UPCAST=INTERPRETING, SPLIT=split, BM=cfg["BM"], BK=cfg["BK"], PF=cfg["PF"],
                  num_warps=cfg["warps"], num_stages=3, **pdl_kw())
    if n_e == 1:
        _gate_route_kernel[(1, 1, m_tiles * split)](*args, T, E, H, xs.stride(0), k_split, float(scaling),
                                                    BLOCK_E=BE, **common)
    else:
        NC = triton.next_power_of_2(n_e * KP)            # a row's candidates: K of each tile, KP apart
        cand = empty((2, T, NC), torch.float32, x.device)        # their keys, then their scores
        _gate_tiles_kernel[(n_e, 1, m_tiles * split)](*args, cand, empty((T, NC), torch.int32, x.device),
                                                      tk[m_tiles * n_e:], T, E, H, xs.stride(0), k_split,
                                                      float(scaling), BN=BN, NC=NC, **common)
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


# rows up to which a gate wider than one tile (V4.1's 384 experts) runs in the one launch; above, the GEMM library
# + `route`. H200 session 14 (V4.1 gate: 384 experts, hidden 5120, top 6, 3.9 MB of weight, 0.93 us at the copy
# rate; 16 calls back to back in a CUDA graph over 16 gate weights, past the L2; us a call, each case twice in one
# run, .round script): R3, tiles of 128 (gate_config) at 8 / 16 / 32 / 64 / 256 rows 9.62-9.71 / 10.07-10.20 /
# 11.80-11.95 / 13.96-14.15 / 23.08-23.13 against the GEMM library + `route` 10.47-11.23 / 11.36-11.40 /
# 11.32-11.33 / 11.03-11.86 / 13.62-13.66 (HEAD's route) and 9.58-10.05 / 10.57-10.61 / 10.59-10.60 / 11.03-11.04
# / 12.73-12.83 (`route` with a row a warp, kept); 32 / 64-row blocks (64-wide tiles, BK 64) at 64 rows
# 14.25-14.70 / 15.26-15.41, at 256 20.73-20.92 / 24.64-24.70. R2: the GEMM library alone 7.4-8.1 / 9.4 us at
# 64 / 256 rows, `route` alone (HEAD's) 4.1-4.3. Above 16 rows the row blocks' re-reads of the weight cost more
# than the second launch. Measured and deleted (R1-R2): the tiles' logits to a workspace and the row block's last
# program running the whole rows' tail (4 rows at a time) 21.9-22.0 / 30.7-30.8 / 40.0 at 8 / 64 / 256 rows (the
# same launch without that tail 6.4-6.8 / 10.7 / 20.7); tiles of 256 (BK 64) 14.4 / 15.6-20.2 / 27.0,
# kernels.skinny's product + `route` 10.1-10.2 / 10.4-10.9 / 16.7-16.9.
TILED_MAX_ROWS = 16


def gate_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """Dispatch: on CUDA the one-launch kernel for a 16-bit dtype (an fp32 dot on the GPU runs in tf32: session 8
    R3 saw its routes differ) up to FUSED_MAX_ROWS rows (TILED_MAX_ROWS for a gate wider than one tile), else the
    GEMM then `route` (its kernel on CUDA, the twin elsewhere)."""
    if use_triton(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16):
        if x.shape[0] <= (FUSED_MAX_ROWS if one_tile(weight.shape[0], x.element_size()) else TILED_MAX_ROWS):
            return gate_route_triton(x, weight, bias, top_k, scaling)
    return route(F.linear(x, weight), bias, top_k, scaling)
