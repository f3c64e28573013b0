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
quantize_fp8_rows or, from a checkpoint, by engine/quant.py's expert_to_fp8): weights are read at 1 byte, widened to fp16
(or bf16) in registers, and each output channel's scale applied to the fp32 accumulator (weights-only
quantization, activations stay bf16).
Block scales (the checkpoint's: 1x32 groups along the input dim for FP4 experts, 32x32 blocks for FP8 ones):
`shifts=(g1, g3, g2)` uint8 [E, ceil(K / 32), ceil(N / shift_rows)] (group-major, so a K tile's shifts are one
contiguous run) with the row scale the row's LARGEST block scale, so block (r, k) scales by row_scale * 2**-shift.
The K tiles are then one 32-wide group: the tile's dot product (fp32) is multiplied per output column by
2**-shift (built from exponent bits), exact for any shift <= 126 and independent of the widening dtype.
Packed FP4 (uint8 [E, N, K/2], two E2M1 codes a byte, element 2i in the low nibble; always with shifts; N and K
multiples of 8): kernels of their own with the operands swapped (section "packed FP4, swapped"): the weights,
read as int32 words of 8 codes, are decoded in registers to bf16 with their group's shift folded in (exact;
about 2.1 operations a weight) and are the first operand of the dot, the activations (permuted into the
decode's column order) the second; one dot chain accumulates over K steps of several 32-groups. Extra bytes:
1 per 32 weights.

PDL (backend.pdl_kw; session 12): the four launches (align, gate/up, down, combine) are programmatic dependent
launches. Each waits before its first load: the alignment reads the router's ids, and the grouped kernels'
first loads are the alignment's blocks (_block_rows), whose expert picks the weights, so no weight load can come
before the wait. The alignment (one wave of E programs) lets the gate/up launch start at once; gate/up, down and
combine trigger late, after their K loops. H200, us a call in a chain of 20 layers (mid-size H=2048 F=1024
E=64 K=6; V4.1 in a chain of 4), PDL off -> on, round 3 (w4_tiles): mid-size T=8 / 64 / 256 59.0-59.2 ->
56.3-56.5, 90.3-90.5 -> 87.3-87.4, 126.4-126.5 -> 123.6-124.1; V4.1 T=8 316.5-318.1 -> 313.0-314.1, T=64
1533-1576 -> 1556-1581, T=256 2467-2478 -> 2465-2493 (V4.1 T=64 / 256 within their runs' spread: neutral; round
2 the same, V4.1 T=64 runs spread 1532-1868 whatever the setting). Measured and deleted (round 2, against the
late triggers' 88.6-88.9 at mid-size T=64): gate/up and down triggering right after their wait 89.3-89.4; the
down kernel asking the L2 for its weight rows before its wait (round 1, V4.1 T=64 1714-1762 against 1581-1629);
the combine folded into the down kernel's epilogue (a ticket per token and H tile, the last pair adding the
token's K rows in order: the same bits) 90.0-90.1, at T=256 (8 warps) 127.6-127.7 against 123.8-124.1, at T=8
59.9-60.4 against 60.0-60.2, V4.1 T=8 319.4-325.1 against 316.7-317.5.
The alignment launch's share of the chain (session 13 R2, mid-size, the chain handed HEAD's alignment made outside
the graph): T=64 85.9-86.1 against 88.0-88.2, T=256 128.7-129.5 against 134.2-135.1. Measured and deleted: the
alignment inside the router's launch (every block of rows ranking its pairs, the last to finish through a ticket
laying out all of them, no launch of its own), router + chain T=8 / 64 / 256 63.8-67.2 / 94.8-95.3 / 153.9-155.3
against 61.4-62.3 / 92.1-92.3 / 152.4-153.4 for HEAD's router then align launch (R2; R1's first form, 128 pairs a
step in its last program: 65.0-69.1 / 103.4-103.6 / 158.7-159.9 against 62.4-62.6 / 92.6-93.0 / 153.5-154.3): the
serial tail in one program (two tickets, two round trips to memory) costs more than the 64-program launch it
replaces.
Session 15, measured and deleted: the shared expert inside the packed FP4 launches (one more expert that every
token picks with weight 1: its ceil(T / BLOCK_M) blocks the first programs of both grids, its 16-bit weights and
the block's activation rows through tensor descriptors, 32 input columns a step, its rows added after the routed
ones by the combine; taken by MoE.forward_grouped from 32 tokens). The whole MoE layer (gate + routed + shared +
combine as forward_grouped(parts=True) returns it; 20 layers in a CUDA graph, V4.1 4; R2, us a layer), HEAD (the
shared expert on the side stream) -> inside: mid-size T = 32 / 64 / 256 92.6-92.8 / 98.2-98.8 / 154.3-172.6 ->
94.8-96.5 / 109.3-109.5 / 171.7-173.0, V4.1 T = 64 / 256 1211-1217 / 1984-1986 -> 1251-1254 / 2136-2165; the gate
and routed experts alone 90.0-90.9 / 96.0-96.6 / 146.4-146.6, V4.1 1197-1227 / 1989-1992, so the side stream costs
the layer 2-8 us. A shared program streams 4x a routed one's bytes (a gate/up tile 1 MB at mid-size). R1's first
form (its blocks first in the 2-D grid, activations by plain loads a step ahead) 111.7 / 121.8 / 174.0, V4.1 1308 /
2217; R2 with 64 columns a step (104 KB of shared memory: 2 programs an SM) 95.1 / 118.0 / 167.3, with a 4-stage
pipeline 95.8 / 108.0 / 170.2.
"""
import torch
import triton
import triton.language as tl

from .backend import empty, INTERPRETING, check, pdl_kw, pdl_trigger, pdl_wait, sm_count, use_triton


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_packed_fp4(w: torch.Tensor) -> bool:
    """Expert weights given as packed FP4 bytes (two E2M1 codes per byte, element 2i in the low nibble)."""
    return w.dtype in (torch.uint8, torch.int8)


def packed_fp4_fits(hidden: int, inter: int) -> bool:
    """Whether the packed FP4 kernels take experts of these dims (they read int32 words of 8 weights)."""
    return hidden % 8 == 0 and inter % 8 == 0


def _check(x, ids, weights, w1, w3, w2, scales=None, shifts=None, shift_rows=1):
    check(x.dim() == 2, f"x must be [tokens, hidden], got {tuple(x.shape)}")
    T, H = x.shape
    check(ids.dim() == 2 and ids.shape[0] == T, f"expert ids must be [{T}, k], got {tuple(ids.shape)}")
    check(weights.shape == ids.shape, f"routing weights must be {tuple(ids.shape)}, got {tuple(weights.shape)}")
    packed = is_packed_fp4(w1)
    c = 2 if packed else 1                   # packed FP4: the input dim holds two weights per byte
    what = " (packed FP4: in/2 bytes)" if packed else ""
    check(w1.dim() == 3 and w1.shape[2] * c == H, f"w1 must be [experts, inter, {H // c}]{what}, got {tuple(w1.shape)}")
    E, F, _ = w1.shape
    check(w3.shape == (E, F, H // c) and w3.dtype == w1.dtype, f"w3 must be {w1.dtype} {(E, F, H // c)}{what}, got "
          f"{w3.dtype} {tuple(w3.shape)}")
    check(w2.shape == (E, H, F // c) and F % c == 0 and w2.dtype == w1.dtype,
          f"w2 must be {w1.dtype} {(E, H, F // c)}{what}, got {w2.dtype} {tuple(w2.shape)}")
    fp8 = w1.dtype == torch.float8_e4m3fn or packed
    check(fp8 == (scales is not None), "float8_e4m3fn (or packed FP4) expert weights need scales=(s1, s3, s2), "
          "and only they")
    check(not packed or shifts is not None, "packed FP4 expert weights need their group shifts (shifts=...)")
    if fp8:
        s1, s3, s2 = scales
        check(s1.shape == (E, F) and s3.shape == (E, F) and s2.shape == (E, H),
              f"fp8 scales must be [{E}, {F}], [{E}, {F}], [{E}, {H}], got "
              f"{tuple(s1.shape)}, {tuple(s3.shape)}, {tuple(s2.shape)}")
    if shifts is not None:
        check(fp8, "block-scale shifts need float8_e4m3fn (or packed FP4) weights with row scales")
        R = shift_rows
        for name, g, (n, k) in zip(("w1", "w3", "w2"), shifts, ((F, H), (F, H), (H, F))):
            want = (E, _cdiv(k, 32), _cdiv(n, R))
            check(g.dtype == torch.uint8 and tuple(g.shape) == want,
                  f"{name} block-scale shifts must be uint8 {want} (shift_rows {R}), got {g.dtype} {tuple(g.shape)}")


def quantize_fp8_rows(w: torch.Tensor):
    """[..., rows, cols] -> (float8_e4m3fn weights, fp32 scale per row [..., rows]): w ~= w8 * scale[..., None]."""
    scale = w.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (w.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def _expert(x, w1, w3, w2, limit):
    g = x @ w1.t()
    u = x @ w3.t()
    return (torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)) @ w2.t()


# ---------------------------------------------------------------------------------------------- torch twin
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_expert(w: torch.Tensor, row_scale: torch.Tensor, shift: torch.Tensor | None = None,
                      shift_rows: int = 1) -> torch.Tensor:
    """One expert's fp8 weight [N, K] (or packed FP4 [N, K/2]) with its row scales [N] (and block shifts
    [K/32, N/R], group-major) -> fp32 [N, K]."""
    if is_packed_fp4(w):
        b = w.view(torch.uint8).to(torch.int64)
        codes = torch.stack((b & 15, b >> 4), dim=-1).reshape(w.shape[0], 2 * w.shape[1])
        w = torch.tensor(_E2M1, dtype=torch.float32, device=w.device)[codes]
    out = w.float() * row_scale.float()[:, None]
    if shift is not None:
        N, K = w.shape
        mult = torch.exp2(-shift.t().float()).repeat_interleave(shift_rows, 0)[:N].repeat_interleave(32, 1)[:, :K]
        out = out * mult
    return out


def moe_experts_torch(x, ids, weights, w1, w3, w2, swiglu_limit=10.0, scales=None, shifts=None, shift_rows=1):
    _check(x, ids, weights, w1, w3, w2, scales, shifts, shift_rows)
    if scales is not None:                   # fp8 weights: dequantize per touched expert (below)
        s1, s3, s2 = scales
        g1, g3, g2 = shifts if shifts is not None else (None, None, None)
        deq = lambda w, sc, g, e: dequantize_expert(w[e], sc[e], None if g is None else g[e], shift_rows)  # noqa: E731
    else:
        s1 = s3 = s2 = g1 = g3 = g2 = None
        deq = lambda w, sc, g, e: w[e].float()                               # noqa: E731
    T, K = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = _expert(xf[tok], deq(w1, s1, g1, e), deq(w3, s3, g3, e), deq(w2, s2, g2, e), swiglu_limit)
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
                  CH: tl.constexpr, PDL: tl.constexpr = False):
    """One program per expert e, one launch instead of align_pairs' ~20: every program histograms all P ids
    (a few KB, L2 hits) to find where its padded range starts, then writes its pairs in pair order (stable,
    so deterministic), the -1 padding of its last block and its block ids; program 0 also fills the tail.
    PDL: the ids are the router's (wait first); one wave (E programs), so the gate/up launch may start at once."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
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
                                CH=max(16, min(1024, triton.next_power_of_2(P))), num_warps=4, **pdl_kw())
    return slot_pair, block_expert


@triton.jit
def _e2m1_half(nib):
    """E2M1 codes (int32, 0..15) -> fp16 holding value * 2**-14: sign to bit 15, the exponent and mantissa bits
    (e e m) to bits 11..9, so the fp16 exponent field is e (bias 15 against E2M1's 1) and e = 0 lands on fp16
    subnormals exactly like E2M1's (0.5 * 2**-14 = 2**-15). Four integer operations, no table."""
    bits = ((nib & 8) << 12) | ((nib & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _group_mult(g_ptr, e, n, k0, N, K, GR: tl.constexpr):
    """fp32 [BN] multipliers 2**-shift of the 32-wide K group starting at k0 for output rows n, from
    g [E, ceil(K/32), ceil(N/GR)] (group-major: one contiguous run of bytes). Built from exponent bits, so exact."""
    d = tl.load(g_ptr + (e.to(tl.int64) * ((K + 31) // 32) + k0 // 32) * ((N + GR - 1) // GR) + n // GR,
                mask=(n < N) & (k0 < K), other=0).to(tl.int32)
    return ((127 - tl.minimum(d, 126)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _w_tile(w_ptr, w_desc, e, n, nt, N, k0, K, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """Expert e's weight tile, rows n (tile nt), columns k0..k0+BK: [BN, BK]. TMA: through the tensor descriptor
    over w as [E*N, K]."""
    if TMA:
        t = w_desc.load([e * N + nt * BN, k0])
    else:
        kk = k0 + tl.arange(0, BK)
        t = tl.load(w_ptr + e.to(tl.int64) * N * K + n[:, None] * K + kk[None, :],
                    mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
    return t


@triton.jit
def _a_tile(a_ptr, rows, valid, k0, K, BK: tl.constexpr):
    """Activation tile [BM, BK]: rows `rows` (int64) of a [*, K], columns k0..k0+BK; invalid rows read 0."""
    kk = k0 + tl.arange(0, BK)
    return tl.load(a_ptr + rows[:, None] * K + kk[None, :], mask=valid[:, None] & (kk[None, :] < K), other=0.0)


@triton.jit
def _mac(acc, a, wt, m, F32: tl.constexpr, FP8: tl.constexpr, CD: tl.constexpr, GS: tl.constexpr):
    """acc [BM, BN] += a @ wt^T (times m [BN] with block shifts: then the tile is one 32-wide group, so the
    shift is a per-column factor of the fp32 partial product; no reshape of the weight tile). fp8 tiles are
    widened to CD."""
    if F32:
        d = tl.dot(a.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
    elif FP8:
        d = tl.dot(a.to(CD), tl.trans(wt.to(CD)))
    else:
        d = tl.dot(a.to(wt.dtype), tl.trans(wt))
    if GS:
        d = d * m[None, :]
    return acc + d


@triton.jit
def _block_rows(slot_pair_ptr, block_expert_ptr, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """This program's block (program id 0) and output tile (id 1): (its expert, -1 for an empty block; the tile;
    the block's slots; the pair in each, -1 for padding; the tile's output rows). PDL: the alignment (and the
    activations) come from the kernels before, so every grouped kernel waits here, before its first load."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    nt = tl.program_id(1)
    slots = b * BM + tl.arange(0, BM)
    return tl.load(block_expert_ptr + b), nt, slots, tl.load(slot_pair_ptr + slots), nt * BN + tl.arange(0, BN)


@triton.jit
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, s1_ptr, s3_ptr, h_ptr, slot_pair_ptr, block_expert_ptr,
                    H, F, K_TOP, limit, g1_ptr, g3_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    F32: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr, CD: tl.constexpr = tl.bfloat16,
                    GS: tl.constexpr = False, GR: tl.constexpr = 1, PF: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Program (block of one expert's pairs, F tile): h = silu(min(x W1^T, L)) * clamp(x W3^T, -L, L).
    TMA: the weight tiles come through tensor descriptors over w [E*F, H] (Hopper's bulk copy engine), which
    the compiler pipelines; PF: the activation tile and the block shifts (plain loads, not pipelined by the
    compiler) are loaded one K step ahead, so their latency overlaps a step's dots."""
    e, nt, slots, pair, n = _block_rows(slot_pair_ptr, block_expert_ptr, BM, BN, PDL)
    if e >= 0:
        tok = tl.where(pair >= 0, pair // K_TOP, 0).to(tl.int64)
        acc1 = tl.zeros([BM, BN], tl.float32)
        acc3 = tl.zeros([BM, BN], tl.float32)
        ok = pair >= 0
        if PF:                                   # the next K step's activations and shifts, a step ahead
            a0 = _a_tile(x_ptr, tok, ok, 0, H, BK)
            m1 = _group_mult(g1_ptr, e, n, 0, F, H, GR) if GS else 0
            m3 = _group_mult(g3_ptr, e, n, 0, F, H, GR) if GS else 0
        for k0 in range(0, H, BK):
            w1t = _w_tile(w1_ptr, w1_desc, e, n, nt, F, k0, H, BN, BK, TMA)
            w3t = _w_tile(w3_ptr, w3_desc, e, n, nt, F, k0, H, BN, BK, TMA)
            if PF:
                c0, cm1, cm3 = a0, m1, m3
                a0 = _a_tile(x_ptr, tok, ok, k0 + BK, H, BK)
                m1 = _group_mult(g1_ptr, e, n, k0 + BK, F, H, GR) if GS else 0
                m3 = _group_mult(g3_ptr, e, n, k0 + BK, F, H, GR) if GS else 0
            else:
                c0 = _a_tile(x_ptr, tok, ok, k0, H, BK)
                cm1 = _group_mult(g1_ptr, e, n, k0, F, H, GR) if GS else 0
                cm3 = _group_mult(g3_ptr, e, n, k0, F, H, GR) if GS else 0
            acc1 = _mac(acc1, c0, w1t, cm1, F32, FP8, CD, GS)
            acc3 = _mac(acc3, c0, w3t, cm3, F32, FP8, CD, GS)
        pdl_trigger(PDL)
        if FP8:                                  # per-output-channel scales of the fp8 weights
            sn = e.to(tl.int64) * F + n
            acc1 = acc1 * tl.load(s1_ptr + sn, mask=n < F, other=0.0)[None, :]
            acc3 = acc3 * tl.load(s3_ptr + sn, mask=n < F, other=0.0)[None, :]
        g = tl.minimum(acc1, limit)
        act = g * tl.sigmoid(g) * tl.minimum(tl.maximum(acc3, -limit), limit)
        tl.store(h_ptr + slots[:, None].to(tl.int64) * F + n[None, :], act.to(h_ptr.dtype.element_ty),
                 mask=n[None, :] < F)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, w2_desc, s2_ptr, y_ptr, wts_ptr, slot_pair_ptr, block_expert_ptr, H, F, g2_ptr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, TMA: tl.constexpr,
                 FP8: tl.constexpr, CD: tl.constexpr = tl.bfloat16, GS: tl.constexpr = False, GR: tl.constexpr = 1,
                 PF: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (block of one expert's pairs, H tile): y[pair] = weight[pair] * (h W2^T), one row per pair."""
    e, nt, slots, pair, n = _block_rows(slot_pair_ptr, block_expert_ptr, BM, BN, PDL)
    if e >= 0:
        acc = tl.zeros([BM, BN], tl.float32)
        rows = slots.to(tl.int64)
        ok = pair >= 0
        if PF:
            a0 = _a_tile(h_ptr, rows, ok, 0, F, BK)
            m2 = _group_mult(g2_ptr, e, n, 0, H, F, GR) if GS else 0
        for k0 in range(0, F, BK):
            w2t = _w_tile(w2_ptr, w2_desc, e, n, nt, H, k0, F, BN, BK, TMA)
            if PF:
                c0, cm2 = a0, m2
                a0 = _a_tile(h_ptr, rows, ok, k0 + BK, F, BK)
                m2 = _group_mult(g2_ptr, e, n, k0 + BK, H, F, GR) if GS else 0
            else:
                c0 = _a_tile(h_ptr, rows, ok, k0, F, BK)
                cm2 = _group_mult(g2_ptr, e, n, k0, H, F, GR) if GS else 0
            acc = _mac(acc, c0, w2t, cm2, F32, FP8, CD, GS)
        pdl_trigger(PDL)
        if FP8:
            acc = acc * tl.load(s2_ptr + e.to(tl.int64) * H + n, mask=n < H, other=0.0)[None, :]
        p = tl.maximum(pair, 0).to(tl.int64)
        wt = tl.load(wts_ptr + p, mask=pair >= 0, other=0.0)
        tl.store(y_ptr + p[:, None] * H + n[None, :], acc * wt[:, None], mask=(pair[:, None] >= 0) & (n[None, :] < H))


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, K_TOP: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum_k y[t*K + k] in k order (deterministic), cast to the output dtype: one launch."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    acc = tl.zeros([BH], tl.float32)
    for k in tl.static_range(K_TOP):
        acc += tl.load(y_ptr + (t * K_TOP + k) * H + h, mask=h < H, other=0.0)
    pdl_trigger(PDL)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


# ---------------------------------------------------------------------------------------------- packed FP4, swapped
# Packed FP4 with the operands swapped: the weight tile is the dot's FIRST operand ([BN out rows, BK in], decoded in
# registers: on Hopper it feeds wgmma straight from registers, no shared-memory round trip of the decoded tile) and
# the activations the second ([BK, BM tokens], through shared memory). The decode folds each 32-wide group's
# 2**-shift into the weights (exactly: bf16 holds value * 2**-shift for any shift <= 126), so one dot chain
# accumulates in place over BK-wide steps of several groups (each row's BK/2 bytes a step: whole sectors). A
# group row is 4 int32 words of 8 nibbles; each word decodes to 4 bf16x2 registers (_e2m1_bf16x8, 2.1
# operations a weight with the shift). The decoded columns come out in that decode's order; the activations are
# read as stored and permuted to match in registers (_w4_act) instead of re-laying the weights. The activations
# and shifts (plain loads, not pipelined by the compiler) are loaded a step ahead; the weight tiles come through
# pipelined tensor descriptors.
@triton.jit
def _e2m1_bf16x8(w, f):
    """int32 word of 8 E2M1 nibbles and f (bf16x2, both lanes 2**(126 - shift)) -> 4 int32 bf16x2 words holding
    the weights * 2**-shift: word i holds nibble i (low lane) and i + 4 (high lane). A nibble's sign at bit 15 and
    its exponent-mantissa bits (e e m) at bits 8..6 is the bf16 of value * 2**-126 (e = 0 lands on bf16
    subnormals exactly like E2M1's 0.5); the product with f is exact (results >= 2**-127). Both bit moves are one
    multiply of the word's two nibbles (isolated, so no carries) by 2**6 + 2**12, then a mask: 2.1 operations a
    weight. PTX: compiled only."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 v, m;
        and.b32 m, $4, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $0, m, $5;
        and.b32 m, $4, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $1, m, $5;
        shr.b32 v, $4, 8;
        and.b32 m, v, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $2, m, $5;
        and.b32 m, v, 0x00F000F0; mul.lo.u32 m, m, 0x104; and.b32 m, m, 0x81C081C0; mul.rn.bf16x2 $3, m, $5;
        }""", "=r,=r,=r,=r,r,r", [w, f], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _w4_tile(w_ptr, w_desc, e, n, nt, N, k0, K, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """Expert e's packed weights of rows n (tile nt), input columns k0..k0+BK, as int32 words [BN, BK/8] (8
    nibbles a word; zeros past K). w is viewed int32 [E, N, K/8]."""
    if TMA:
        t = w_desc.load([e * N + nt * BN, k0 // 8])
    else:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        t = tl.load(w_ptr + e.to(tl.int64) * N * (K // 8) + n[:, None] * (K // 8) + kw[None, :],
                    mask=(n[:, None] < N) & (kw[None, :] < K // 8), other=0)
    return t


@triton.jit
def _w4_factors(g_ptr, e, n, k0, N, K, GR: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """Per row n and 32-group of the step at k0, [BN, BK/32] (word w of the step's [BN, BK/8] tile is in group
    w/4), from the shifts g [E, ceil(K/32), ceil(N/GR)] (group-major): the decode's factor 2**(126 - shift) as
    bf16x2 bits (F32: 2**-shift, fp32). Shifts above 126 count as 126 (as _group_mult)."""
    kg = k0 // 32 + tl.arange(0, BK // 32)
    d = tl.load(g_ptr + (e.to(tl.int64) * ((K + 31) // 32) + kg[None, :]) * ((N + GR - 1) // GR) + n[:, None] // GR,
                mask=(n[:, None] < N) & (kg[None, :] * 32 < K), other=0).to(tl.int32)
    d = tl.minimum(d, 126)
    if F32:
        f = ((127 - d) << 23).to(tl.float32, bitcast=True)
    else:
        f = d * -0x00800080 + 253 * 0x00800080      # the bf16 exponent field 253 - shift in both lanes (one IMAD)
    return f


@triton.jit
def _bf16_lanes(p):
    """int32 bf16x2 words -> (low lane, high lane) as bf16."""
    return p.to(tl.int16).to(tl.bfloat16, bitcast=True), (p >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _w4_plain(ww, f, a: tl.constexpr):
    """Decoded register a of words ww with factors f (fp32 2**-shift) without PTX (the interpreter's path), fp32
    (lane 0, lane 1): the PTX's values (_e2m1_half's fp16 is value * 2**-14)."""
    lo = _e2m1_half((ww >> (4 * a)) & 0xF).to(tl.float32) * 16384.0 * f
    hi = _e2m1_half((ww >> (4 * a + 16)) & 0xF).to(tl.float32) * 16384.0 * f
    return lo, hi


@triton.jit
def _w4_decode(ww, f, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """[BN, BK/8] int32 words and their factors (_w4_factors) -> [BN, BK] weights * 2**-shift (bf16; F32: fp32
    without PTX, the interpreter's path) in the decode's column order: [BN, group b, register a, word c, lane h]
    flattened, so a thread's values of a row (a dot-operand layout holds columns 8A + 2c + h) come from its own
    words 4b + c. Decoded column 32b + 8a + 2c + h is nibble a + 4h of word 4b + c: input column
    32b + 8c + 4h + a (_w4_act gathers the activations in this order)."""
    f = tl.broadcast_to(f[:, :, None], [BN, BK // 32, 4]).reshape(BN, BK // 8)
    if F32:
        l0, h0 = _w4_plain(ww, f, 0)
        l1, h1 = _w4_plain(ww, f, 1)
        l2, h2 = _w4_plain(ww, f, 2)
        l3, h3 = _w4_plain(ww, f, 3)
    else:
        p0, p1, p2, p3 = _e2m1_bf16x8(ww, f)
        l0, h0 = _bf16_lanes(p0)
        l1, h1 = _bf16_lanes(p1)
        l2, h2 = _bf16_lanes(p2)
        l3, h3 = _bf16_lanes(p3)
    lo = tl.join(tl.join(l0, l2), tl.join(l1, l3)).reshape(BN, BK // 32, 4, 4).permute(0, 1, 3, 2)   # [BN, b, a, c]
    hi = tl.join(tl.join(h0, h2), tl.join(h1, h3)).reshape(BN, BK // 32, 4, 4).permute(0, 1, 3, 2)
    return tl.join(lo, hi).reshape(BN, BK)


@triton.jit
def _w4_act(a_ptr, rows, valid, k0, K, BM: tl.constexpr, BK: tl.constexpr):
    """The activations the step at k0 meets, [BK, BM] (zeros past K and for invalid rows): a[rows, k0:k0+BK] read
    as stored (whole rows: vector loads), then its columns put in the decode's order (_w4_decode: column
    32b + 8a + 2c + h meets input column 32b + 8c + 4h + a, a permutation of the index bits, so a reshape and
    permute)."""
    kk = k0 + tl.arange(0, BK)
    a = tl.load(a_ptr + rows[:, None] * K + kk[None, :], mask=valid[:, None] & (kk[None, :] < K), other=0.0)
    return tl.trans(a.reshape(BM, BK // 32, 4, 2, 4).permute(0, 1, 4, 2, 3).reshape(BM, BK))


@triton.jit
def _w4_mac(acc, ww, f, at, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """acc [BN, BM] += decoded step [BN, BK] @ at [BK, BM] (bf16 operands, fp32 accumulation in place)."""
    w = _w4_decode(ww, f, BN, BK, F32)
    if F32:
        acc = tl.dot(w, at.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, at.to(tl.bfloat16), acc)
    return acc


@triton.jit
def _w4_gate_up_kernel(x_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, s1_ptr, s3_ptr, g1_ptr, g3_ptr, h_ptr,
                       slot_pair_ptr, block_expert_ptr, H, F, K_TOP, limit, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, TMA: tl.constexpr, F32: tl.constexpr, GR: tl.constexpr,
                       PDL: tl.constexpr = False):
    """_gate_up_kernel for packed FP4 with swapped operands (section comment): program (block of one expert's
    pairs, F tile of BN rows), BK input columns a loop step; accumulators [BN, BM] (rows x tokens)."""
    e, nt, slots, pair, n = _block_rows(slot_pair_ptr, block_expert_ptr, BM, BN, PDL)
    if e >= 0:
        tok = tl.where(pair >= 0, pair // K_TOP, 0).to(tl.int64)
        ok = pair >= 0
        acc1 = tl.zeros([BN, BM], tl.float32)
        acc3 = tl.zeros([BN, BM], tl.float32)
        a1 = _w4_act(x_ptr, tok, ok, 0, H, BM, BK)               # a step ahead (section comment)
        f1n = _w4_factors(g1_ptr, e, n, 0, F, H, GR, BK, F32)
        f3n = _w4_factors(g3_ptr, e, n, 0, F, H, GR, BK, F32)
        for k0 in range(0, H, BK):
            w1t = _w4_tile(w1_ptr, w1_desc, e, n, nt, F, k0, H, BN, BK, TMA)
            w3t = _w4_tile(w3_ptr, w3_desc, e, n, nt, F, k0, H, BN, BK, TMA)
            at, f1, f3 = a1, f1n, f3n
            a1 = _w4_act(x_ptr, tok, ok, k0 + BK, H, BM, BK)
            f1n = _w4_factors(g1_ptr, e, n, k0 + BK, F, H, GR, BK, F32)
            f3n = _w4_factors(g3_ptr, e, n, k0 + BK, F, H, GR, BK, F32)
            acc1 = _w4_mac(acc1, w1t, f1, at, BN, BK, F32)
            acc3 = _w4_mac(acc3, w3t, f3, at, BN, BK, F32)
        pdl_trigger(PDL)                         # late (module doc: PDL)
        sn = e.to(tl.int64) * F + n
        acc1 = acc1 * tl.load(s1_ptr + sn, mask=n < F, other=0.0)[:, None]
        acc3 = acc3 * tl.load(s3_ptr + sn, mask=n < F, other=0.0)[:, None]
        g = tl.minimum(acc1, limit)
        act = g * tl.sigmoid(g) * tl.minimum(tl.maximum(acc3, -limit), limit)
        tl.store(h_ptr + slots[None, :].to(tl.int64) * F + n[:, None], act.to(h_ptr.dtype.element_ty),
                 mask=n[:, None] < F)


@triton.jit
def _w4_down_kernel(h_ptr, w2_ptr, w2_desc, s2_ptr, g2_ptr, y_ptr, wts_ptr, slot_pair_ptr, block_expert_ptr, H, F,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, F32: tl.constexpr,
                    GR: tl.constexpr, PDL: tl.constexpr = False):
    """_down_kernel for packed FP4 with swapped operands: y[pair] = weight[pair] * (h W2^T), one row per pair."""
    e, nt, slots, pair, n = _block_rows(slot_pair_ptr, block_expert_ptr, BM, BN, PDL)
    if e >= 0:
        rows = slots.to(tl.int64)
        ok = pair >= 0
        acc = tl.zeros([BN, BM], tl.float32)
        a1 = _w4_act(h_ptr, rows, ok, 0, F, BM, BK)
        f2n = _w4_factors(g2_ptr, e, n, 0, H, F, GR, BK, F32)
        for k0 in range(0, F, BK):
            w2t = _w4_tile(w2_ptr, w2_desc, e, n, nt, H, k0, F, BN, BK, TMA)
            at, f2 = a1, f2n
            a1 = _w4_act(h_ptr, rows, ok, k0 + BK, F, BM, BK)
            f2n = _w4_factors(g2_ptr, e, n, k0 + BK, H, F, GR, BK, F32)
            acc = _w4_mac(acc, w2t, f2, at, BN, BK, F32)
        pdl_trigger(PDL)
        acc = acc * tl.load(s2_ptr + e.to(tl.int64) * H + n, mask=n < H, other=0.0)[:, None]
        p = tl.maximum(pair, 0).to(tl.int64)
        wt = tl.load(wts_ptr + p, mask=ok, other=0.0)
        tl.store(y_ptr + p[None, :] * H + n[:, None], acc * wt[None, :], mask=ok[None, :] & (n[:, None] < H))


# fp8 weights: gate/up tiles (H200 round 2 sweep: 128-wide N tiles over 128-wide K tiles, 8 warps, TMA loads).
# Block shifts need one 32-wide group per K tile (the shift is then a per-column factor of the partial product).
# Session 3 scaled the widened weights per group in registers instead, with 64-wide tiles (V4.1 T=64: 2.50 ms vs
# 2.16 per-row; bk128 3.23): that [BN, BK/32, 32] reshape (and packed FP4's nibble join) faulted with
# "misaligned address" on the H200 at small tiles, so it was replaced by this form.
FP8_TILES = dict(block_n=128, block_k=128, num_warps=8)
# H200 session 4 (V4.1 T=64, 1x32 shifts): 128 x 32 tiles with 4 warps and 3 stages 2.42-2.64 ms (85-88% of the
# bytes); 8 warps 3.12-3.28, 4 / 2 stages 2.93 / 2.98, 64-wide N tiles 2.68-2.94 ms; 32x32 block shifts 2.57 ms.
FP8_SHIFT_TILES = dict(block_n=128, block_k=32, num_warps=4, num_stages=3)
# 32-wide K steps: the activation and shift loads of the next step issued a step early (session 4 round 2, V4.1
# T=64: 2.64 ms against 3.11 without)
PREFETCH_SHIFTED = True
# Packed FP4 tiles (the swapped-operand kernels). H200 session 6 round 2 (V4.1, T = 64 / 8 / 256, us): 128 rows,
# 4 warps, 3 stages 2168 / 476 / 3415 (49-50% of the FP4 bytes; the fp8 path in the same run 2144 / 451 / 3422);
# 4 / 6 stages 2158 / 2163; 256 rows 2372 / 552 / 3677, with 8 warps 2271; 64 rows 2862 / 642 / 4514.
# Measured and deleted (same run unless said): the activations and shifts loaded in the step that uses them
# 2736 (round 1: 3.3-3.6 ms, every step waited on them), two steps ahead (the sm_90 build then stopped
# pipelining the weight tiles); two groups a step (round 1, no prefetch: 3522 against 3616); the decodes placing
# the bits in fp16 directly (about 1.9 operations a weight) 2168 and through fp16 high bytes + byte permutes
# 2171 (this one: 2168); the session 4 kernel (weights second, decoded tiles through shared memory, low / high
# nibbles against even / odd activation columns) 2401 / 3940 (round 1: 2380 / 3737).
# Session 8 round 2 (V4.1, T = 64 / 8 / 256, us): the shifts folded into the decoded weights (one mul.f16x2 per
# two weights, exact for shifts <= 23) so the dot accumulates in place: 3322 / 695 / 4955 against 2228 / 480 /
# 3363 for the kept form (fp8 rows 2143 / 438 / 3259) -> deleted.
# Session 9 (V4.1, T = 64 / 8, us; this form 2145-2188 / 472, fp8 rows 2033-2078 / 432): ncu put it at 75-78% of
# the L2's throughput with DRAM at 37-42% (each step's word tiles are 16 bytes wide per row, half a sector), the
# top stall the shift loads' use. Measured and deleted: the shifts through tensor descriptors, pipelined like the
# weights, 3502 / 780; the shifts asked of the L2 8 groups ahead (prefetch.global.L2) 2293 / 489; two groups a
# step as two word tiles each (174 registers) 2868 / 652; four groups a step from one 64-byte-wide word tile
# (L2 55%, DRAM 45%, but 255 registers: 2 programs an SM, stalls on issue, wgmma waits and the activation
# tile's shared-memory staging) 2168 / 481, with 4 stages 2176 / 484, 8 warps 2711 / 595, 64 rows 2796 / 593.
# Session 10 round 2 (V4.1, T = 64 / 8, us, same bits): the packed bytes laid out by K block ([E, K/32, N, 16],
# each step's word tile one contiguous 2 KB run instead of 16 bytes a row) 2400-2407 / 523 (43 / 38% of the
# FP4 bytes) against 2085-2093 / 465 (50 / 43%) for this layout -> deleted.
# Session 11 (this form: the shifts folded into a bf16 decode, one dot chain in place over K steps of block_k;
# V4.1, T = 64 / 8 / 256, us, % of the FP4 bytes; HEAD's kernel above in the same runs 2085-2165 / 464-467 /
# 3405-3725, 45-50 / 43%). ncu at T = 64 (gate/up, down): HEAD's at 60 / 69% of issue slots busy (ALU pipe
# 54-56%), its gate/up loop 4.2 SASS instructions a weight (round 1); this form at block_k 128 57 / 65%, 3.1
# instructions a weight (2.1 of them the decode), DRAM reads unchanged (round 2). Rounds 1-3, block_k = 128 / 64,
# 4 warps, 3 stages: 1585-1652 / 1535-1694, 352-374 / 327-385, 2606-2670 / 2448-2885 (61-68%); 4 stages at 128
# 1581-1670 / 341-376 / 2581-2730. Round 3, each twice in one run: register caps (maxnreg 168 for gate/up: 3
# programs an SM instead of 2 at 185 registers; 128 for down: 4 instead of 3; no spills) at block_k = 128
# 1467-1485 / 313-314 / 2440-2444 (70-71 / 63-64 / 68%, the default); gate/up at 128 capped, down at 64 uncapped
# 1509-1588 / 322 / 2615-2691; gate/up at 64, down at 128 capped 1566-1612 / 319 / 2556-2632; 64-row tiles at 64
# 1757-1790 / 376 / 2867-2885. Round 4 (copy 4226 GB/s), each twice: the default 1401-1414 / 312 / 2290-2319
# (74-75 / 64 / 72-73%), HEAD's 2096-2099 / 466-467 / 3369-3393, the fp8 rows path (FP8_TILES, the loader's CUDA
# default) 1989-1990 / 420-468 / 3277-3278 (96-99% of its bytes: packed FP4 is now the faster of the two); 4
# stages 1418 / 314 / 2307-2492; gate/up capped at 128 registers too (4 programs an SM, 136 B of spills)
# 1581-1666 / 345 / 2596-2662. T = 8 stays at 64%: its 810 gate/up programs fill 3 programs x 132 SMs 2.05 times.
# Measured and deleted: the shifts through tensor descriptors ([groups, rows] boxes,
# 156 / 127 registers, no layout conversion of the factors but more operations) at block_k 128 / 64: 1565 / 1648,
# 340 / 351, 2793 / 2753 (round 2). The first build of this form sent the decoded tile through shared memory
# (per-word factors loaded a step ahead fixed its layout); per-group factors broadcast in registers keep it out
# (perhaps why session 8's fold lost).
# Registers of the launched builds (session 12, H200; `benchmarks/kernels.py --compile-check` builds these kernels
# without the caps and the launches' integer specialisations, 229 / 163): 16-row blocks, capped, gate/up 165 and
# down 128, no spills; 32-row blocks capped 168 / 128 with 46 / 38 bytes spilled, at 8 warps uncapped (w4_tiles)
# 119 / 105; 64-row gate/up tiles (w4_tiles' small grids) 117; 64-row blocks at 8 warps (not taken) 181 / 153.
# None spill but the capped 32-row ones. The fp8 / bf16 grouped kernels take the same PDL waits and triggers: the
# fp8 rows path (FP8_TILES) at mid-size T=64, 20-call chain, PDL off / on 117.1-117.6 / 113.8-114.1 us (81 / 84% of
# its bytes; session 13 R1), so they keep them.
# Session 13 (mid-size H=2048 F=1024 E=64 K=6, 20-call chains in a CUDA graph, HEAD's kernels in the same run, us a
# call): the gate/up grid at T=64 is 1.3 waves of 3 programs an SM, but cutting H in slices does not pay. Measured
# and deleted (R1): split-K gate/up (grid blocks x F tiles x slices; fp32 partials [slices, 2, slots, F] and a
# ticket per tile, the last program adding them in slice order before the SwiGLU) at T=64 2 / 4 slices 97.1-97.5 /
# 100.9-101.5, with 128-register caps 105.5-105.6, at T=256 2 slices 145.4-145.8, against HEAD's 87.9-88.5 /
# 134.7-135.0; at T=8 60.6-61.2 against the unsplit build's 58.1. The run-time slice bounds alone cost the unsplit
# capped 16-row build 5 us (93.2-93.7); 128-register caps for gate/up (4 programs an SM) 95.2 against that build.
# Session 15 (the sm_90 SASS of the launched gate/up build at 16-row blocks, capped: 165 registers; built on a CPU
# with the launches' divisibility hints): the K loop is 784 instructions a step of 128 columns (256 weights a thread,
# 3.06 a weight): the decode 17 a word of 8 weights (LOP3 8, IMAD 4, HMUL2 4, SHF 1: 2.1 a weight, 69% of the loop),
# 32 HGMMA, 8 LDSM (the word tiles), and the group factors sent through shared memory (8 STS, 32 LDS and 3 of the
# loop's 6 BAR.SYNC a step: their loads' coalesced layout is not the decode's). A factor byte loaded per word
# ([BN, BK/8]) builds a worse loop (1106 instructions: more is exchanged); an inline-PTX byte load per (row, group)
# keeps the factors' layout and sends the word tiles through shared memory instead (809). Timing bounds (wrong
# results): a constant shift without loads builds a 688-instruction loop with 3 barriers; no decode, 369. R3, the
# chain (20 calls in a CUDA graph, V4.1 4), us a call, this kernel / no factor loads / no decode: mid-size T = 64
# 87.9-88.9 / 89.8-90.4 / 84.3-85.0 (57% of 214 MB at 4250 GB/s), T = 256 114.3-116.5 / 110.6-112.1 / 104.3-110.3,
# V4.1 T = 64 1389-1460 / 1313 / 1248-1250: at mid-size the decode is worth at most 4-9% and the factors' exchange
# nothing (its programs mostly wait), at V4.1 T = 64 the exchange ~6% and the decode ~10%. Measured and deleted (R4,
# mid-size chain): gate/up capped at 128 registers (4 programs an SM, so the ~512 gate/up programs of T = 16-64 fit
# one wave instead of 1.3; 136 B of spills) T = 64 / 32 / 16 87.4-88.5 / 85.9-86.9 / 73.6-73.8 -> 93.9-95.1 /
# 93.0-93.9 / 85.1-85.7.
# Session 16 (mid-size, us; HEAD's launches alone, 20 calls in a CUDA graph, two input sets, R1 / R2): the gate/up
# time steps with the programs an SM must run, not with the grid's waves as such. T = 64 with the 384 pairs dealt
# evenly over N experts (one 16-row block each, N x 8 programs of 128 rows; 3 programs an SM fit: 396 slots):
# 192 / 320 / 384 programs 37.9-38.2 / 38.7-39.1 / 39.1-40.3 us, 400 / 448 / 512 53.0-53.7 / 53.9-54.6 / 54.6-55.7
# (down, 4 an SM: 384 / 768 / 1024 programs 16.4 / 25.4-26.2 / 29.5-30.4); T = 256 (8 warps, 2 an SM): 384 / 512 /
# 528 programs 52.3 / 63.5 / 63.5-64.7, down 34.5 / 43.1 / 43.2-43.8. R3, a copy storing each program's %smid
# and %globaltimer at its start and end (no PDL): at T = 64 (512 programs) 114 SMs ran 4, 17 ran 3 and one 5; the
# first 396 ran three to an SM for 35.1 us on average, the 116 left alone for 20.4; over 24 experts (192 programs)
# the scheduler left 21 SMs empty and gave 21 three: one alone 19.1 us, two together 25.4, three 32.0. So a program
# costs its SM ~11.7 us with three resident but 19-20 alone (latency-bound; ncu, R3, three resident: ALU pipe 52%,
# wgmma 9%, SM throughput 51%), and T = 64's tail of lone programs costs ~10 us against an even spread of the work
# (512 x 11.7 / 132 = 45 us against 55). T = 16 (384 programs, 2-3 an SM) and T = 256 (528: 4 an SM, 2 at a time)
# are balanced. The lead for T = 32-64: a stream-K walk (396 resident programs, each 1/396 of the K steps of all
# tiles; a tile cut between two programs summed in a fixed order by the one that ends it, its other piece done first).
# Measured and deleted (the chain, us a call, HEAD in the same run), R1: gate/up split over H in 2 / 4 slices (grid
# blocks x F tiles x slices, a constant slice length, fp32 partials [slices, 2, slots, F] summed in slice order and
# put through the SwiGLU by a launch of their own: bit-deterministic) T = 16 / 64 / 256 77.5-78.3 / 93.8-93.9 /
# 134.6-135.0 (4 slices, T = 64: 106.0-106.7) against 72.7-73.1 / 87.4-88.0 / 114.6-115.1; the partials summed and
# activated in the down kernel's prologue instead (no extra launch, but each of a block's 16 H tiles re-reads 8x the
# activation bytes; 64 B of spills at the 128-register cap) 94.7-94.9 / 115.7-115.8 / 241.3-242.3; launched alone
# at T = 64, gate/up tiles of 64 rows (1024 programs, 2.6 waves) 56.8-57.1 against 54.6-54.9, down tiles of 64 rows
# (2048 programs) 35.1-35.4 and of 256 rows at 8 warps (512) 30.7 against 29.5-29.6. R2: a persistent grid (3 / 4
# programs an SM walking the used blocks' tiles, blocks fastest; Triton's loop flattening did not apply to this nest)
# T = 64 98.3-99.0 against 88.4-88.5, T = 256 (2 an SM) 140.6-140.7 against 115.8-116.2: the hardware's block
# scheduler already hands the tail to the SMs that free up, and a static walk gives some programs two tiles on
# crowded SMs; the kernels built with mma.sync instead of wgmma (Triton's DISABLE_MMA_V3; 64 HMMA a step, the
# activations through shared memory, 2072 SASS instructions against 1560) T = 16 / 64 / 256 139.9 / 161.3-165.8 /
# 278.0-278.3 against 73.9-74.0 / 88.4-88.5 / 115.8-116.2.
W4_TILES = dict(block_n=128, block_k=128, num_warps=4, num_stages=3, maxnreg=(168, 128))


def w4_tiles(T: int, K: int, E: int, F: int, device) -> dict:
    """W4_TILES for T tokens routed to K of E experts of F gate/up rows (session 12, H200, us a call in a chain of
    20 layers, mid-size H=2048 F=1024 E=64 K=6; HEAD's tiles -> these, PDL on, round 3):
    - 32-row blocks (default_block_m; mid-size T=256) take 8 warps without register caps: the capped 4-warp builds
      spill there (46 / 38 bytes a thread) and stall on those loads (ncu, round 2: issue slots 40% busy, 56% at 8
      warps), 170.3-170.7 -> 123.6-124.1 (126.4-126.5 with PDL off). Round 2: 8 warps for gate/up alone 137, 16-row
      blocks 155, 64-row gate/up tiles 140. Not at 64 rows (V4.1 prefill, T=4096: 8693-8751 against 8075-8273 for
      4 uncapped warps; the fp8 rows path 10577-10584) nor at 16 (mid-size T=64 91.6-91.9 against 87.3-87.4, V4.1
      T=64 1671-1678 against 1556-1581).
    - A gate/up grid under one wave of 3 programs an SM (at most min(T*K, E) experts x F/128 tiles; mid-size T=8)
      takes 64-row tiles, twice the programs: 61.9-62.1 -> 56.3-56.5 (59.0-59.2 with PDL off); with 8 warps too
      80.9-81.8. At mid-size T=64 (512 programs) 64-row tiles gave 90.1-90.7 against 88.6-88.9 (round 2). Only
      at 16-row blocks, where it was measured.
    - 64-row blocks (prefill) take W4_TILES without register caps (the capped builds spill 688 / 320 bytes a
      thread against the compiler's 224 / 0, sm_90). The caps are decided here only: moe_experts_triton applies
      what it is given.
    V4.1 decode shapes (T = 8 / 64 / 256) keep W4_TILES: 16-row blocks, 864+ gate/up programs."""
    block_m = default_block_m(T, K, E)
    if block_m > 16:
        return dict(W4_TILES, num_warps=8 if block_m == 32 else 4, maxnreg=None)
    bn, bk, warps, stages = (W4_TILES[k] for k in ("block_n", "block_k", "num_warps", "num_stages"))
    if min(T * K, E) * _cdiv(F, bn) < 3 * sm_count(device):
        return dict(W4_TILES, block_n=64, down=(bn, bk, warps, stages))
    return W4_TILES


# Tensor-descriptor weight loads by default (when the shapes allow). H200 round 1: as fast as the pointer loads
# (200 vs 202 us at T=64), and their sm_90 build does not spill (the pointer build spills 808 B per thread).
TMA_DEFAULT = True


def default_block_m(T: int, K: int, E: int) -> int:
    """Rows per block: the mean pairs per expert rounded up to a power of two, between 16 and 64. Measured on
    the H200 (T=256, E=64, K=6: ~24 pairs per expert): 16 rows 257 us, 32 rows 226 us, 64 rows 242 us; an
    expert's second block runs right after its first, so its weights mostly come from L2 again."""
    return max(16, min(64, triton.next_power_of_2(max(1, -(-T * K // E)))))


def tma_ok(w: torch.Tensor, box: tuple[int, int]) -> bool:
    """Whether a 2-D tensor descriptor over w (viewed [rows, w.shape[-1]]) with this box is legal for Hopper's
    bulk copy: 16-byte aligned base and row stride (contiguous rows of a multiple of 16 bytes), an inner box of
    at least 16 bytes, and a box whose bytes are a multiple of 128 (the pipelined shared-memory slots of the
    copies sit back to back, and each copy's destination must be 128-byte aligned)."""
    es = w.element_size()
    return (w.is_contiguous() and w.data_ptr() % 16 == 0 and (w.shape[-1] * es) % 16 == 0
            and box[1] * es >= 16 and (box[0] * box[1] * es) % 128 == 0)


def moe_experts_triton(x, ids, weights, w1, w3, w2, swiglu_limit=10.0, block_m=None, block_n=64, block_k=128,
                       num_warps=None, num_stages=3, down=None, tma=None, align="triton", scales=None,
                       fp8_compute="fp16", shifts=None, shift_rows=1, prefetch=None, maxnreg=None):
    """block_m None: default_block_m. (block_n, block_k, num_warps, num_stages) tile the gate/up kernel; `down`
    (same 4-tuple, None: the same) the down kernel; num_warps None: 4 for 16-row blocks, else 8 (sm_90 builds
    without spills). tma (None: TMA_DEFAULT): weight tiles through tensor descriptors when `tma_ok` allows;
    the sm_90 build then stages them in shared memory (pipelined), while the pointer loads go to registers
    (and spill at bk=128).
    align: "triton" (one launch) or "torch" (align_pairs). scales: fp8 weights' per-row scales (module doc);
    fp8_compute: "fp16" or "bf16", the dtype the fp8 weights (and the activations) are widened to for the dot
    (H200 round 2, toy T=64: fp16 120 us, bf16 172 us: e4m3 -> fp16 is one conversion instruction).
    shifts / shift_rows: the block scales' shifts (module doc); the K tiles are then 32 wide (one group).
    prefetch (None: PREFETCH_SHIFTED with shifts, else off): activations and shifts loaded a K step ahead.
    Packed FP4 (uint8 weights, always with shifts) goes through the swapped-operand kernels (_w4_*: the tiles
    and `down` as above, block_k a multiple of 32; in dims must be multiples of 8); maxnreg (gate/up, down):
    register caps of those two builds (None: the compiler's choice, which w4_tiles picks for all but 16-row
    blocks), so more programs fit an SM."""
    _check(x, ids, weights, w1, w3, w2, scales, shifts, shift_rows)
    T, H = x.shape
    K = ids.shape[1]
    E, F, _ = w1.shape
    if T == 0:
        return x.new_zeros(0, H)
    block_m = block_m or default_block_m(T, K, E)
    num_warps = num_warps or (4 if block_m <= 16 else 8)
    dn, dk, dw, ds = down or (block_n, block_k, num_warps, num_stages)
    gs = shifts is not None
    w4 = is_packed_fp4(w1)
    check(not w4 or packed_fp4_fits(H, F),
          f"the packed FP4 kernels read int32 words of 8 weights: hidden {H} and inter {F} must be multiples of 8")
    check(not gs or w4 or (block_k == 32 and dk == 32),
          f"block scales need K tiles of one 32-group, got {block_k}, {dk}")
    check(not w4 or (block_k % 32 == 0 and dk % 32 == 0),
          f"packed FP4 K tiles are whole 32-groups, got {block_k}, {dk}")
    pf = (PREFETCH_SHIFTED and gs) if prefetch is None else bool(prefetch)
    slot_pair, block_expert = (align_pairs_triton if align == "triton" else align_pairs)(ids, E, block_m)
    pdl = pdl_kw()
    n_blocks = block_expert.numel()
    fp8 = scales is not None
    f32 = w1.dtype == torch.float32 or INTERPRETING          # (fp8 with F32: fp32 dots, scales still applied)
    cd = tl.float16 if fp8_compute == "fp16" else tl.bfloat16
    if fp8:
        s1, s3, s2 = (sc.float().contiguous() for sc in scales)
    else:
        s1 = s3 = s2 = x
    g1, g3, g2 = (g.contiguous() for g in shifts) if gs else (x, x, x)
    w1, w3, w2 = w1.contiguous(), w3.contiguous(), w2.contiguous()
    c = 1
    if w4:                                    # int32 words [E, N, K/8] (8 nibbles a word)
        w1, w3, w2 = w1.view(torch.int32), w3.view(torch.int32), w2.view(torch.int32)
        c = 8
    box_up, box_down = ((block_n, block_k // 8), (dn, dk // 8)) if w4 else ((block_n, block_k), (dn, dk))
    tma = ((TMA_DEFAULT if tma is None else bool(tma)) and tma_ok(w1, box_up) and tma_ok(w3, box_up)
           and tma_ok(w2, box_down))
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        d1 = TensorDescriptor.from_tensor(w1.view(E * F, H // c), list(box_up))
        d3 = TensorDescriptor.from_tensor(w3.view(E * F, H // c), list(box_up))
        d2 = TensorDescriptor.from_tensor(w2.view(E * H, F // c), list(box_down))
    else:
        d1 = d3 = d2 = None
    h_dtype = torch.float32 if w1.dtype == torch.float32 else (torch.bfloat16 if fp8 else w1.dtype)
    h = empty((n_blocks * block_m, F), h_dtype, x.device)
    y = empty((T * K, H), torch.float32, x.device)
    x = x.contiguous()
    if w4:
        caps = maxnreg or (None, None)
        _w4_gate_up_kernel[(n_blocks, triton.cdiv(F, block_n))](x, w1, w3, d1, d3, s1, s3, g1, g3, h, slot_pair,
                                                                block_expert, H, F, K, float(swiglu_limit),
                                                                BM=block_m, BN=block_n, BK=block_k, TMA=tma,
                                                                F32=f32,
                                                                GR=shift_rows, num_warps=num_warps,
                                                                num_stages=num_stages, maxnreg=caps[0], **pdl)
        _w4_down_kernel[(n_blocks, triton.cdiv(H, dn))](h, w2, d2, s2, g2, y, weights.float().contiguous(),
                                                        slot_pair, block_expert, H, F, BM=block_m, BN=dn, BK=dk,
                                                        TMA=tma, F32=f32, GR=shift_rows, num_warps=dw, num_stages=ds,
                                                        maxnreg=caps[1], **pdl)
        return _combine(y, T, H, K, x.dtype)
    _gate_up_kernel[(n_blocks, triton.cdiv(F, block_n))](x, w1, w3, d1, d3, s1, s3, h, slot_pair, block_expert, H,
                                                         F, K, float(swiglu_limit), g1, g3, BM=block_m,
                                                         BN=block_n, BK=block_k, F32=f32, TMA=tma, FP8=fp8, CD=cd,
                                                         GS=gs, GR=shift_rows, PF=pf,
                                                         num_warps=num_warps,
                                                         num_stages=num_stages, **pdl)
    _down_kernel[(n_blocks, triton.cdiv(H, dn))](h, w2, d2, s2, y, weights.float().contiguous(), slot_pair,
                                                 block_expert, H, F, g2, BM=block_m, BN=dn, BK=dk, F32=f32,
                                                 TMA=tma, FP8=fp8, CD=cd, GS=gs, GR=shift_rows, PF=pf,
                                                 num_warps=dw, num_stages=ds, **pdl)
    return _combine(y, T, H, K, x.dtype)


def _combine(y, T, H, K, dtype):
    """The pairs' rows y [T*K, H] fp32 summed per token in k order -> [T, H] in dtype (one launch)."""
    out = empty((T, H), dtype, y.device)
    bh = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, bh))](y, out, H, K_TOP=K, BH=bh, num_warps=4, **pdl_kw())
    return out


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, swiglu_limit: float = 10.0, scales=None, shifts=None, shift_rows: int = 1,
                fp8_compute: str = "fp16") -> torch.Tensor:
    """Weighted sum of each token's routed experts (module docstring); scales: fp8 weights' per-row scales;
    shifts / shift_rows: their block scales (module doc); fp8_compute: "bf16" where fp16 would not be exact."""
    if use_triton(x):
        kw = (FP8_SHIFT_TILES if shifts is not None else FP8_TILES) if scales is not None else {}
        if is_packed_fp4(w1):
            kw = w4_tiles(x.shape[0], ids.shape[1], w1.shape[0], w1.shape[1], x.device)
        return moe_experts_triton(x, ids, weights, w1, w3, w2, swiglu_limit, scales=scales, shifts=shifts,
                                  shift_rows=shift_rows, fp8_compute=fp8_compute, **kw)
    return moe_experts_torch(x, ids, weights, w1, w3, w2, swiglu_limit, scales=scales, shifts=shifts,
                             shift_rows=shift_rows)
