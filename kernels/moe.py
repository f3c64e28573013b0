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

FP8 weights (optional, `scales=(s1 [E, F], s3 [E, F], s2 [E, H])` fp32 with float8_e4m3fn w1/w3/w2; made by
quantize_fp8_rows): weights are read at 1 byte, widened to bf16 in registers, and each output channel's
scale applied to the fp32 accumulator (weights-only quantization, activations stay bf16). Per-row scales,
not the checkpoint's 32-element blocks: the engine's loader dequantizes to bf16 today, so this path is for the
benchmark until the loader keeps FP8.
"""
import torch
import triton
import triton.language as tl

from .backend import empty, INTERPRETING, check, use_triton


def _check(x, ids, weights, w1, w3, w2, scales=None):
    check(x.dim() == 2, f"x must be [tokens, hidden], got {tuple(x.shape)}")
    T, H = x.shape
    check(ids.dim() == 2 and ids.shape[0] == T, f"expert ids must be [{T}, k], got {tuple(ids.shape)}")
    check(weights.shape == ids.shape, f"routing weights must be {tuple(ids.shape)}, got {tuple(weights.shape)}")
    check(w1.dim() == 3 and w1.shape[2] == H, f"w1 must be [experts, inter, {H}], got {tuple(w1.shape)}")
    E, F, _ = w1.shape
    check(w3.shape == (E, F, H), f"w3 must be {(E, F, H)}, got {tuple(w3.shape)}")
    check(w2.shape == (E, H, F), f"w2 must be {(E, H, F)}, got {tuple(w2.shape)}")
    fp8 = w1.dtype == torch.float8_e4m3fn
    check(fp8 == (scales is not None), "float8_e4m3fn expert weights need scales=(s1, s3, s2), and only they")
    if fp8:
        s1, s3, s2 = scales
        check(s1.shape == (E, F) and s3.shape == (E, F) and s2.shape == (E, H),
              f"fp8 scales must be [{E}, {F}], [{E}, {F}], [{E}, {H}], got "
              f"{tuple(s1.shape)}, {tuple(s3.shape)}, {tuple(s2.shape)}")


def quantize_fp8_rows(w: torch.Tensor):
    """[..., rows, cols] -> (float8_e4m3fn weights, fp32 scale per row [..., rows]): w ~= w8 * scale[..., None]."""
    scale = w.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (w.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def _expert(x, w1, w3, w2, limit):
    g = x @ w1.t()
    u = x @ w3.t()
    return (torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)) @ w2.t()


# ---------------------------------------------------------------------------------------------- torch twin
def moe_experts_torch(x, ids, weights, w1, w3, w2, swiglu_limit=10.0, scales=None):
    _check(x, ids, weights, w1, w3, w2, scales)
    if scales is not None:                   # fp8 weights: dequantize per touched expert (below)
        s1, s3, s2 = scales
        deq = lambda w, sc, e: w[e].float() * sc[e].float()[:, None]          # noqa: E731
    else:
        s1 = s3 = s2 = None
        deq = lambda w, sc, e: w[e].float()                                  # noqa: E731
    T, K = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = _expert(xf[tok], deq(w1, s1, e), deq(w3, s3, e), deq(w2, s2, e), swiglu_limit)
        out.index_add_(0, tok, y * weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------- Triton
def align_pairs(ids: torch.Tensor, n_experts: int, block_m: int):
    """(slot_pair [n_blocks*block_m] pair id or -1, block_expert [n_blocks] expert or -1), sorted by expert.
    Plain-torch version (about 20 small launches): the oracle of `_align_kernel` and its fallback."""
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
def _align_kernel(ids_ptr, slot_pair_ptr, block_expert_ptr, P, E, NB, BM: tl.constexpr, EP: tl.constexpr,
                  CH: tl.constexpr):
    """One program per expert e, one launch instead of align_pairs' ~20: every program histograms all P ids
    (a few KB, L2 hits) to find where its padded range starts, then writes its pairs in pair order (stable,
    so deterministic), the -1 padding of its last block and its block ids; program 0 also fills the tail."""
    e = tl.program_id(0)
    bins = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for p0 in range(0, P, CH):
        p = p0 + tl.arange(0, CH)
        v = tl.load(ids_ptr + p, mask=p < P, other=0).to(tl.int32)
        counts += tl.histogram(v, EP, mask=(p < P) & (v >= 0) & (v < E))
    padded = (counts + BM - 1) // BM * BM
    start = tl.sum(tl.where(bins < e, padded, 0), 0)
    count = tl.sum(tl.where(bins == e, counts, 0), 0)
    end = start + (count + BM - 1) // BM * BM
    run = 0
    for p0 in range(0, P, CH):
        p = p0 + tl.arange(0, CH)
        v = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        hit = (v == e) & (p < P)
        rank = run + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(slot_pair_ptr + start + rank, p, mask=hit)
        run += tl.sum(hit.to(tl.int32), 0)
    pad = start + count + tl.arange(0, BM)
    tl.store(slot_pair_ptr + pad, tl.full([BM], -1, tl.int32), mask=pad < end)
    for b0 in range(start // BM, end // BM, CH):
        blk = b0 + tl.arange(0, CH)
        tl.store(block_expert_ptr + blk, tl.full([CH], 0, tl.int32) + e, mask=blk < end // BM)
    if e == 0:                                   # slots and blocks past the last expert's range
        total = tl.sum(padded, 0)
        for s0 in range(total, NB * BM, CH):
            s = s0 + tl.arange(0, CH)
            tl.store(slot_pair_ptr + s, tl.full([CH], -1, tl.int32), mask=s < NB * BM)
        for b0 in range(total // BM, NB, CH):
            blk = b0 + tl.arange(0, CH)
            tl.store(block_expert_ptr + blk, tl.full([CH], -1, tl.int32), mask=blk < NB)


def align_pairs_triton(ids: torch.Tensor, n_experts: int, block_m: int):
    """align_pairs in one Triton launch (int32 outputs, same contents)."""
    flat = ids.reshape(-1).contiguous()
    P = flat.numel()
    n_blocks = triton.cdiv(P, block_m) + n_experts
    slot_pair = empty((n_blocks * block_m,), torch.int32, ids.device)
    block_expert = empty((n_blocks,), torch.int32, ids.device)
    _align_kernel[(n_experts,)](flat, slot_pair, block_expert, P, n_experts, n_blocks, BM=block_m,
                                EP=max(16, triton.next_power_of_2(n_experts)),
                                CH=max(16, min(1024, triton.next_power_of_2(P))), num_warps=4)
    return slot_pair, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, s1_ptr, s3_ptr, h_ptr, slot_pair_ptr, block_expert_ptr,
                    H, F, K_TOP, limit, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                    TMA: tl.constexpr, FP8: tl.constexpr, CD: tl.constexpr = tl.bfloat16):
    """Program (block of one expert's pairs, F tile): h = silu(min(x W1^T, L)) * clamp(x W3^T, -L, L).
    TMA: the weight tiles come through tensor descriptors over w [E*F, H] (Hopper's bulk copy engine)."""
    b = tl.program_id(0)
    nt = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e >= 0:
        slots = b * BM + tl.arange(0, BM)
        pair = tl.load(slot_pair_ptr + slots)
        tok = tl.where(pair >= 0, pair // K_TOP, 0).to(tl.int64)
        n = nt * BN + tl.arange(0, BN)
        acc1 = tl.zeros([BM, BN], tl.float32)
        acc3 = tl.zeros([BM, BN], tl.float32)
        wbase = e.to(tl.int64) * F * H
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + tok[:, None] * H + kk[None, :], mask=(pair[:, None] >= 0) & (kk[None, :] < H),
                         other=0.0)
            if TMA:
                w1t = w1_desc.load([e * F + nt * BN, k0])                                      # [BN, BK]
                w3t = w3_desc.load([e * F + nt * BN, k0])
            else:
                wm = (n[:, None] < F) & (kk[None, :] < H)
                w1t = tl.load(w1_ptr + wbase + n[:, None] * H + kk[None, :], mask=wm, other=0.0)
                w3t = tl.load(w3_ptr + wbase + n[:, None] * H + kk[None, :], mask=wm, other=0.0)
            if F32:
                acc1 += tl.dot(xt.to(tl.float32), tl.trans(w1t.to(tl.float32)), input_precision="ieee")
                acc3 += tl.dot(xt.to(tl.float32), tl.trans(w3t.to(tl.float32)), input_precision="ieee")
            elif FP8:                            # widened to CD (bf16, or fp16: one cvt from e4m3)
                acc1 += tl.dot(xt.to(CD), tl.trans(w1t.to(CD)))
                acc3 += tl.dot(xt.to(CD), tl.trans(w3t.to(CD)))
            else:
                acc1 += tl.dot(xt.to(w1t.dtype), tl.trans(w1t))
                acc3 += tl.dot(xt.to(w3t.dtype), tl.trans(w3t))
        if FP8:                                  # per-output-channel scales of the fp8 weights
            sn = e.to(tl.int64) * F + n
            acc1 = acc1 * tl.load(s1_ptr + sn, mask=n < F, other=0.0)[None, :]
            acc3 = acc3 * tl.load(s3_ptr + sn, mask=n < F, other=0.0)[None, :]
        g = tl.minimum(acc1, limit)
        act = g * tl.sigmoid(g) * tl.minimum(tl.maximum(acc3, -limit), limit)
        tl.store(h_ptr + slots[:, None].to(tl.int64) * F + n[None, :], act.to(h_ptr.dtype.element_ty),
                 mask=n[None, :] < F)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, w2_desc, s2_ptr, y_ptr, wts_ptr, slot_pair_ptr, block_expert_ptr, H, F,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, TMA: tl.constexpr,
                 FP8: tl.constexpr, CD: tl.constexpr = tl.bfloat16):
    """Program (block of one expert's pairs, H tile): y[pair] = weight[pair] * (h W2^T), one row per pair."""
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
            if TMA:
                w2t = w2_desc.load([e * H + nt * BN, k0])                                      # [BN, BK]
            else:
                w2t = tl.load(w2_ptr + wbase + n[:, None] * F + kk[None, :],
                              mask=(n[:, None] < H) & (kk[None, :] < F), other=0.0)
            if F32:
                acc += tl.dot(ht.to(tl.float32), tl.trans(w2t.to(tl.float32)), input_precision="ieee")
            elif FP8:
                acc += tl.dot(ht.to(CD), tl.trans(w2t.to(CD)))
            else:
                acc += tl.dot(ht.to(w2t.dtype), tl.trans(w2t))
        if FP8:
            acc = acc * tl.load(s2_ptr + e.to(tl.int64) * H + n, mask=n < H, other=0.0)[None, :]
        p = tl.maximum(pair, 0).to(tl.int64)
        wt = tl.load(wts_ptr + p, mask=pair >= 0, other=0.0)
        tl.store(y_ptr + p[:, None] * H + n[None, :], acc * wt[:, None], mask=(pair[:, None] >= 0) & (n[None, :] < H))


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, K_TOP: tl.constexpr, BH: tl.constexpr):
    """out[t] = sum_k y[t*K + k] in k order (deterministic), cast to the output dtype: one launch."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    acc = tl.zeros([BH], tl.float32)
    for k in tl.static_range(K_TOP):
        acc += tl.load(y_ptr + (t * K_TOP + k) * H + h, mask=h < H, other=0.0)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


# Tensor-descriptor weight loads by default (when the shapes allow). H200 round 1: as fast as the pointer loads
# (200 vs 202 us at T=64), and their sm_90 build does not spill (the pointer build spills 808 B per thread).
TMA_DEFAULT = True


def default_block_m(T: int, K: int, E: int) -> int:
    """Rows per block: the mean pairs per expert rounded up to a power of two, between 16 and 64. Measured on
    the H200 (T=256, E=64, K=6: ~24 pairs per expert): 16 rows 257 us, 32 rows 226 us, 64 rows 242 us; an
    expert's second block runs right after its first, so its weights mostly come from L2 again."""
    return max(16, min(64, triton.next_power_of_2(max(1, -(-T * K // E)))))


def _tma_ok(*ws) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides (contiguous weights with rows of 16 B)."""
    return all(w.data_ptr() % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0 for w in ws)


def moe_experts_triton(x, ids, weights, w1, w3, w2, swiglu_limit=10.0, block_m=None, block_n=64, block_k=128,
                       num_warps=None, num_stages=3, down=None, tma=None, align="triton", scales=None,
                       fp8_compute="fp16"):
    """block_m None: default_block_m. (block_n, block_k, num_warps, num_stages) tile the gate/up kernel; `down`
    (same 4-tuple, None: the same) the down kernel; num_warps None: 4 for 16-row blocks, else 8 (sm_90 builds
    without spills). tma (None: TMA_DEFAULT): weight tiles through tensor descriptors when the shapes allow;
    the sm_90 build then stages them in shared memory (pipelined), while the pointer loads go to registers
    (and spill at bk=128).
    align: "triton" (one launch) or "torch" (align_pairs). scales: fp8 weights' per-row scales (module doc);
    fp8_compute: "fp16" or "bf16", the dtype the fp8 weights (and the activations) are widened to for the dot
    (H200 round 2, toy T=64: fp16 120 us, bf16 172 us: e4m3 -> fp16 is one conversion instruction)."""
    _check(x, ids, weights, w1, w3, w2, scales)
    T, H = x.shape
    K = ids.shape[1]
    E, F, _ = w1.shape
    if T == 0:
        return x.new_zeros(0, H)
    block_m = block_m or default_block_m(T, K, E)
    num_warps = num_warps or (4 if block_m <= 16 else 8)
    dn, dk, dw, ds = down or (block_n, block_k, num_warps, num_stages)
    slot_pair, block_expert = (align_pairs_triton if align == "triton" else align_pairs)(ids, E, block_m)
    n_blocks = block_expert.numel()
    fp8 = scales is not None
    f32 = w1.dtype == torch.float32 or INTERPRETING          # (fp8 with F32: fp32 dots, scales still applied)
    cd = tl.float16 if fp8_compute == "fp16" else tl.bfloat16
    if fp8:
        s1, s3, s2 = (sc.float().contiguous() for sc in scales)
    else:
        s1 = s3 = s2 = x
    w1, w3, w2 = w1.contiguous(), w3.contiguous(), w2.contiguous()
    tma = (TMA_DEFAULT if tma is None else bool(tma)) and _tma_ok(w1, w3, w2)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        d1 = TensorDescriptor.from_tensor(w1.view(E * F, H), [block_n, block_k])
        d3 = TensorDescriptor.from_tensor(w3.view(E * F, H), [block_n, block_k])
        d2 = TensorDescriptor.from_tensor(w2.view(E * H, F), [dn, dk])
    else:
        d1 = d3 = d2 = None
    h_dtype = torch.float32 if w1.dtype == torch.float32 else (torch.bfloat16 if fp8 else w1.dtype)
    h = empty((n_blocks * block_m, F), h_dtype, x.device)
    y = empty((T * K, H), torch.float32, x.device)
    x = x.contiguous()
    _gate_up_kernel[(n_blocks, triton.cdiv(F, block_n))](x, w1, w3, d1, d3, s1, s3, h, slot_pair, block_expert, H,
                                                         F, K, float(swiglu_limit), BM=block_m, BN=block_n,
                                                         BK=block_k, F32=f32, TMA=tma, FP8=fp8, CD=cd,
                                                         num_warps=num_warps, num_stages=num_stages)
    _down_kernel[(n_blocks, triton.cdiv(H, dn))](h, w2, d2, s2, y, weights.float().contiguous(), slot_pair,
                                                 block_expert, H, F, BM=block_m, BN=dn, BK=dk, F32=f32, TMA=tma,
                                                 FP8=fp8, CD=cd, num_warps=dw, num_stages=ds)
    out = empty((T, H), x.dtype, x.device)
    bh = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, bh))](y, out, H, K_TOP=K, BH=bh, num_warps=4)
    return out


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, swiglu_limit: float = 10.0, scales=None) -> torch.Tensor:
    """Weighted sum of each token's routed experts (module docstring); scales: fp8 weights' per-row scales."""
    if use_triton(x):
        return moe_experts_triton(x, ids, weights, w1, w3, w2, swiglu_limit, scales=scales)
    return moe_experts_torch(x, ids, weights, w1, w3, w2, swiglu_limit, scales=scales)
