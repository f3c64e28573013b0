"""Routed-expert MLP for decode batch sizes: a grouped matmul over (token, expert) pairs (doc section 2.7).

  y[t] = sum_k weights[t, k] * Expert_{ids[t, k]}(x[t])
  Expert_e(x) = W2_e (silu(min(x W1_e^T, L)) * clamp(x W3_e^T, -L, L)),   L = swiglu_limit

Shapes: x [T, H]; ids int [T, K]; weights fp32 [T, K] (already normalised and scaled by the router);
w1, w3 [E, F, H]; w2 [E, H, F] (DeepSeek's experts.{e}.w1/w3/w2 stacked, dequantised). Returns [T, H] in x's
dtype (fp32 accumulation). Shared experts and routing stay with the model.

Triton: pairs are sorted by expert into blocks of BLOCK_M slots (each expert padded to a whole block, all on the
device: no host sync), then two grouped kernels: gate/up (grid blocks x F tiles, writes the activated
[slots, F]) and down (grid blocks x H tiles, scales by the routing weight, writes one row per pair). The K rows
of a token are summed in a fixed order, so results are deterministic (no atomics).
Cost at decode sizes: every touched expert's W1, W3, W2 read once per block of its pairs: memory-bound.
"""
import torch
import triton
import triton.language as tl

from .backend import empty, INTERPRETING, check, use_triton


def _check(x, ids, weights, w1, w3, w2):
    check(x.dim() == 2, f"x must be [tokens, hidden], got {tuple(x.shape)}")
    T, H = x.shape
    check(ids.dim() == 2 and ids.shape[0] == T, f"expert ids must be [{T}, k], got {tuple(ids.shape)}")
    check(weights.shape == ids.shape, f"routing weights must be {tuple(ids.shape)}, got {tuple(weights.shape)}")
    check(w1.dim() == 3 and w1.shape[2] == H, f"w1 must be [experts, inter, {H}], got {tuple(w1.shape)}")
    E, F, _ = w1.shape
    check(w3.shape == (E, F, H), f"w3 must be {(E, F, H)}, got {tuple(w3.shape)}")
    check(w2.shape == (E, H, F), f"w2 must be {(E, H, F)}, got {tuple(w2.shape)}")


def _expert(x, w1, w3, w2, limit):
    g = x @ w1.t()
    u = x @ w3.t()
    return (torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)) @ w2.t()


# ---------------------------------------------------------------------------------------------- torch twin
def moe_experts_torch(x, ids, weights, w1, w3, w2, swiglu_limit=10.0):
    _check(x, ids, weights, w1, w3, w2)
    T, K = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = _expert(xf[tok], w1[e].float(), w3[e].float(), w2[e].float(), swiglu_limit)
        out.index_add_(0, tok, y * weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------- Triton
def align_pairs(ids: torch.Tensor, n_experts: int, block_m: int):
    """(slot_pair [n_blocks*block_m] pair id or -1, block_expert [n_blocks] expert or -1), sorted by expert."""
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    n_blocks = triton.cdiv(P, block_m) + n_experts          # static bound: no host sync
    slot_pair = torch.full((n_blocks * block_m,), -1, dtype=torch.int64, device=dev)
    slot_pair[pad_start[sorted_e] + rank] = order
    block_expert = torch.searchsorted(pad_end, torch.arange(n_blocks, device=dev) * block_m, right=True)
    block_expert = torch.where(block_expert < n_experts, block_expert, torch.full_like(block_expert, -1))
    return slot_pair, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, h_ptr, slot_pair_ptr, block_expert_ptr, H, F, K_TOP, limit,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    nt = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e >= 0:
        slots = b * BM + tl.arange(0, BM)
        pair = tl.load(slot_pair_ptr + slots)
        tok = tl.where(pair >= 0, pair // K_TOP, 0)
        n = nt * BN + tl.arange(0, BN)
        acc1 = tl.zeros([BM, BN], tl.float32)
        acc3 = tl.zeros([BM, BN], tl.float32)
        wbase = e.to(tl.int64) * F * H
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + tok[:, None] * H + kk[None, :], mask=(pair[:, None] >= 0) & (kk[None, :] < H),
                         other=0.0)
            wm = (n[None, :] < F) & (kk[:, None] < H)
            w1t = tl.load(w1_ptr + wbase + n[None, :] * H + kk[:, None], mask=wm, other=0.0)     # [BK, BN]
            w3t = tl.load(w3_ptr + wbase + n[None, :] * H + kk[:, None], mask=wm, other=0.0)
            if F32:
                acc1 += tl.dot(xt.to(tl.float32), w1t.to(tl.float32), input_precision="ieee")
                acc3 += tl.dot(xt.to(tl.float32), w3t.to(tl.float32), input_precision="ieee")
            else:
                acc1 += tl.dot(xt.to(w1t.dtype), w1t)
                acc3 += tl.dot(xt.to(w3t.dtype), w3t)
        g = tl.minimum(acc1, limit)
        act = g * tl.sigmoid(g) * tl.minimum(tl.maximum(acc3, -limit), limit)
        tl.store(h_ptr + slots[:, None].to(tl.int64) * F + n[None, :], act.to(h_ptr.dtype.element_ty),
                 mask=n[None, :] < F)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, y_ptr, wts_ptr, slot_pair_ptr, block_expert_ptr, H, F,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    nt = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e >= 0:
        slots = b * BM + tl.arange(0, BM)
        pair = tl.load(slot_pair_ptr + slots)
        n = nt * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], tl.float32)
        wbase = e.to(tl.int64) * H * F
        for k0 in range(0, F, BK):
            kk = k0 + tl.arange(0, BK)
            ht = tl.load(h_ptr + slots[:, None].to(tl.int64) * F + kk[None, :],
                         mask=(pair[:, None] >= 0) & (kk[None, :] < F), other=0.0)
            w2t = tl.load(w2_ptr + wbase + n[None, :] * F + kk[:, None], mask=(n[None, :] < H) & (kk[:, None] < F),
                          other=0.0)
            if F32:
                acc += tl.dot(ht.to(tl.float32), w2t.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(ht.to(w2t.dtype), w2t)
        wt = tl.load(wts_ptr + tl.maximum(pair, 0), mask=pair >= 0, other=0.0)
        tl.store(y_ptr + tl.maximum(pair, 0)[:, None] * H + n[None, :], acc * wt[:, None],
                 mask=(pair[:, None] >= 0) & (n[None, :] < H))


def moe_experts_triton(x, ids, weights, w1, w3, w2, swiglu_limit=10.0, block_m=16, block_n=64, block_k=128,
                       num_warps=4, num_stages=3):
    # defaults: D's best in the H200 sweep (67-68% for all tiles tried). Their gate/up build spills 664 bytes per
    # thread (ptxas resource report); block_k=64 with 8 warps spills nothing: benchmarks/kernels.py times it.
    _check(x, ids, weights, w1, w3, w2)
    T, H = x.shape
    K = ids.shape[1]
    E, F, _ = w1.shape
    slot_pair, block_expert = align_pairs(ids, E, block_m)
    n_blocks = block_expert.numel()
    f32 = w1.dtype == torch.float32 or INTERPRETING
    h = empty((n_blocks * block_m, F), torch.float32 if w1.dtype == torch.float32 else w1.dtype, x.device)
    y = empty((T * K, H), torch.float32, x.device)
    x = x.contiguous()
    _gate_up_kernel[(n_blocks, triton.cdiv(F, block_n))](x, w1.contiguous(), w3.contiguous(), h, slot_pair,
                                                         block_expert, H, F, K, float(swiglu_limit), BM=block_m,
                                                         BN=block_n, BK=block_k, F32=f32, num_warps=num_warps,
                                                         num_stages=num_stages)
    _down_kernel[(n_blocks, triton.cdiv(H, block_n))](h, w2.contiguous(), y, weights.float().contiguous(),
                                                      slot_pair, block_expert, H, F, BM=block_m, BN=block_n,
                                                      BK=block_k, F32=f32, num_warps=num_warps,
                                                      num_stages=num_stages)
    return y.view(T, K, H).sum(1).to(x.dtype)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, swiglu_limit: float = 10.0) -> torch.Tensor:
    """Weighted sum of each token's routed experts (module docstring)."""
    if use_triton(x):
        return moe_experts_triton(x, ids, weights, w1, w3, w2, swiglu_limit)
    return moe_experts_torch(x, ids, weights, w1, w3, w2, swiglu_limit)
