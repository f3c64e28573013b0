"""Products of a few rows with a large weight, `out = x @ w.T`, one program per BN output columns, weight streamed
once (decode-step GEMMs), optionally with V4's clamped SwiGLU of a second (up) product in the same launch.

Contract: x [T, G*K] (rows may be strided: a column block of a wider product), w [G*N, K] contiguous, G groups:
out[t, g*N + n] = sum_k x[t, g*K + k] * w[g*N + n, k] (G = 1: `F.linear(x, w)`; G > 1: block-diagonal per group).
fp32 accumulation, result in x's dtype [T, G*N]. `glu` = (w_up [N, K], limit), G = 1: out = silu(min(x w^T, L)) *
clamp(x w_up^T, -L, L), each product rounded to x's dtype first as separate launches store them: a shared
expert's front half (w1, w3, two clamps, silu, the product: 6 launches) in one.

Split-K (`launch_config`'s SPLIT, `product_tile`): where the output tiles would not fill the GPU, K is cut into
slices, one program each, and the tile's last program to finish adds the slices' fp32 sums in slice order
(deterministic). Without it (session 7, R2, H200, mid-size V4.1 shapes, CUDA graphs, cold weights; us at 8 / 64
rows, GEMM library in brackets): wo_b 2048 x 2048 6.7 / 7.3 (6.5 / 6.6), stacked wq_a + wkv 1280 x 2048 6.6 / 7.1
(6.7 / 6.5), shared w2 4.9 / 5.0 (5.2 / 5.3): the same as the library, both ~5 us over the bytes (the walk over K
a chain of dependent loads). Variants measured and dropped: RoPE of the input inside the
product (attention output + `wo_a`: 35 / 129 us against 14 / 15 for rope + bmm + copy) and RMSNorm + RoPE of the
output (q_norm + `wq_b` + rope: 23 / 31 us against 13 / 14): the rotation's extra loads and the per-program
prologue cost more than the launches they saved. Session 13 R1 (H200, PDL on, 16 calls in a CUDA graph, weights
rotating past the L2, us at 8 / 64 rows): wq_b then the rope launch, GEMM library 10.1 / 11.3, this kernel 13.6 /
11.7; the rotation in this kernel's epilogue (the tile's even / odd columns split in registers, one launch) 12.9 /
15.5: deleted.
Session 15, the attention's projections (engine/attention.py runs them through the GEMM library), H200 R2-R4, 16
calls in a CUDA graph, weights rotating past the L2, PDL on, us a call (% of 4250 GB/s), the library / this
kernel's tiles / BN 128 with 8 warps / BN 128 with 4 warps: mid-size wq_b (768 -> 16384) T = 8 8.66-8.67 (68%) /
12.85 / 9.87-9.92 / 9.48; T = 32 (BK 128) 8.60-8.64 (69%) / - / 8.70-8.72 / 8.32-8.33 (71%); T = 64 9.09-9.24
(65%) / 9.82-9.84 / 8.31-8.32 (71%) / -; T = 256 12.96-13.00 / 31.50-31.60 / 25.36-25.39 / -; wo_a (4 groups 4096
-> 512) T = 64 9.38-9.39 (42%) / 10.91-10.93 / 18.77-18.78, T = 256 10.02-10.09 / 25.69-25.73 / 18.92-18.99; wo_b
(2048 -> 2048) T = 64 6.43-6.46 (31%) / 6.36 / 11.24-11.38, T = 256 6.85-6.92 / 13.83-14.01 / 11.49-11.53; V4.1
wq_b (1280 -> 32768) T = 32 24.03-24.08 (82%) / - / 25.15-25.20 / 24.38-24.45, T = 64 24.61-24.67 (80%) /
28.18-28.22 / 24.93-24.94; V4.1 wo_a (8 groups 4096 -> 1024) T = 64 21.02-21.04 / 20.89-20.91 / 21.45-21.47; wo_b
(8192 -> 5120) T = 64 28.68-28.72 / 29.60-29.64 / 35.65-35.75. Only the mid-size wq_b at 32-64 rows gains (0.3-0.9
us), not V4.1's wq_b nor 8 or 256 rows: the library stays.
Cost: G*N*K weight elements read once per BM rows (T <= BM: once), x read G*N/BN times, T*G*N written (split-K:
plus SPLIT fp32 partial tiles written and read back).

Programmatic dependent launch (session 12, `product_tile`): the first K step's weight lines are asked of the L2
(PREFETCH), then the wait, then x and everything else; the next kernel may launch once every program is past its K
loop. H200 session 12 R3 (benchmarks/kernels_moe.py's pdl sweep, K3_SWEEP=pdl; mid-size V4.1, 64 rows, 16 calls
back to back in a CUDA graph, weights rotating past the L2; us, PDL off -> on, the GEMM library in the same run,
% of the 4250 GB/s copy rate): wq_a + wkv 6.69 -> 6.05 (library 6.05; 20%), wq_b 11.08 -> 10.64 (9.48; 56%), wo_a
10.38 -> 9.43 (9.15; 42%), wo_b 7.08 -> 6.74 (6.27; 29%), shared w1 + w3 with the SwiGLU 8.27 -> 7.78 (17.89;
25%), shared w2 4.74 -> 4.42 (4.92; 22%). In the step's stretches (R3, .round script, us a layer, PDL on, the library's
products beside these): norm, wq_a + wkv, q norm, wq_b, rope 23.27-23.30 against 23.74 (24.0 without the
prefetch); rope, wo_a, wo_b, write-back + mixes 33.96-34.10 against 33.26-33.38; gate_route, shared expert, its
w2, MoE write-back 31.27-31.28 against 32.35-32.54 with the library's w2. Measured and deleted: the program's
whole weight slice asked of the L2 before the wait, evict-last (R1) or evict-normal (R2), slower everywhere (PDL
on: wo_a 14.5-14.9 against 10.1-10.2, wq_b 12.8-13.1 against 10.6-10.7, shared w1 + w3 11.0-11.1 against 7.9).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import INTERPRETING, check, empty, pdl_kw, pdl_trigger, pdl_wait, tickets as shared_tickets, use_triton


def skinny_linear_torch(x: torch.Tensor, w: torch.Tensor, groups: int = 1, glu: tuple | None = None) -> torch.Tensor:
    """The twin (and the CPU path): the grouped product (G = 1: F.linear), [clamped SwiGLU with the up product]."""
    T = x.shape[0]
    if groups == 1:
        y = torch.nn.functional.linear(x, w)
    else:
        g = x.reshape(T, groups, -1)
        y = torch.einsum("tgi,goi->tgo", g, w.view(groups, -1, g.shape[-1])).reshape(T, -1)
    if glu is not None:
        y = swiglu_clamped(y, torch.nn.functional.linear(x, glu[0]), glu[1])
    return y


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's clamped SwiGLU, silu(min(gate, L)) * clamp(up, -L, L): the gate is clamped above only, up on both
    sides (engine/moe.py's experts use it too)."""
    return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@triton.jit
def prefetch_l2(ptrs, mask, base):
    """Ask the L2 for the lines holding `ptrs` where `mask` (elsewhere for `base`, a valid address): no register is
    written and nothing waits for it (compiled kernels only: PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                              [tl.where(mask, ptrs, base).to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _prefetch_step(w_ptr, wrow, nok, k0, k1, BK: tl.constexpr):
    """prefetch_l2 of the weight rows at offsets wrow [BN] (masked by nok), columns k0 .. min(k0 + BK, k1): one
    address a 128-byte line (a step narrower than a line: one address)."""
    LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth     # elements a 128-byte line
    if BK >= LINE:
        kk = k0 + tl.arange(0, BK // LINE) * LINE
    else:
        kk = k0 + tl.arange(0, 1)
    prefetch_l2(w_ptr + wrow[None, :] + kk[:, None], nok[None, :] & (kk < k1)[:, None], w_ptr)


@triton.jit
def product_tile(x_ptr, w_ptr, w3_ptr, part_ptr, ticket_ptr, T, N, K, x_stride, k_split, GLU: tl.constexpr,
                 UPCAST: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PDL: tl.constexpr, PF: tl.constexpr):
    """This program's output tile of x [T, G*K] times w [G*N, K]^T (grid: N tiles, G, row tiles * SPLIT) in fp32,
    [and of the up product with w3]. Split-K (SPLIT > 1): each program sums its slice of K into the workspace
    part [2 * SPLIT, T, G*N] fp32; the tile's last program to finish (a ticket per tile, self-resetting) adds the
    slices in slice order, so the sums do not depend on which program was last.
    PDL (launched with backend.pdl_kw): the weights are constant, so PF (compiled kernels) first asks the L2 for
    this program's first K step of weights (the stream starts under the previous kernel's tail), then the wait,
    before x (an activation) is read and anything is stored; the next kernel may launch once every program is past
    its K loop (its programs then take the slots ours leave).
    -> (acc, up, last: whether this program holds the finished tile, rows, cols, mask)."""
    pn = tl.program_id(0)
    g = tl.program_id(1)
    pm = tl.program_id(2) // SPLIT
    ps = tl.program_id(2) % SPLIT        # this program's slice of K: [ps * k_split, (ps + 1) * k_split)
    NT = N * tl.num_programs(1)          # out's row length
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rok = rows < T
    nok = cols < N
    xrow = x_ptr + rows[:, None].to(tl.int64) * x_stride
    wrow = (g * N + cols).to(tl.int64) * K
    k_end = tl.minimum(ps * k_split + k_split, K)
    if PF:
        _prefetch_step(w_ptr, wrow, nok, ps * k_split, k_end, BK)
        if GLU:
            _prefetch_step(w3_ptr, wrow, nok, ps * k_split, k_end, BK)
    pdl_wait(PDL)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(ps * k_split, k_end, BK):
        k = k0 + tl.arange(0, BK)
        kok = k < K
        x = tl.load(xrow + (g * K + k)[None, :], mask=rok[:, None] & kok[None, :], other=0.0)
        w = tl.load(w_ptr + wrow[None, :] + k[:, None], mask=kok[:, None] & nok[None, :], other=0.0)   # [BK, BN]
        if UPCAST:   # (the interpreter's low-precision dot is wrong: backend.INTERPRETING)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(x, w)
        if GLU:      # the up product over the same x tile
            w3 = tl.load(w3_ptr + wrow[None, :] + k[:, None], mask=kok[:, None] & nok[None, :], other=0.0)
            if UPCAST:
                up += tl.dot(x.to(tl.float32), w3.to(tl.float32))
            else:
                up += tl.dot(x, w3)
    pdl_trigger(PDL)
    mask = rok[:, None] & nok[None, :]
    last = True
    if SPLIT > 1:    # partial sums to the workspace; the tile's last program to finish adds them in split order
        at = rows[:, None].to(tl.int64) * NT + (g * N + cols)[None, :]
        n_part = T * NT
        tl.store(part_ptr + (2 * ps) * n_part + at, acc, mask=mask)
        if GLU:
            tl.store(part_ptr + (2 * ps + 1) * n_part + at, up, mask=mask)
        tl.debug_barrier()               # every thread's partial stores precede the release below
        tile = (pm * tl.num_programs(1) + g) * tl.num_programs(0) + pn
        done = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT - 1
        if last:
            tl.debug_barrier()           # (the acquire above precedes every thread's reads below)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            up = tl.zeros((BM, BN), dtype=tl.float32)
            for j in tl.static_range(SPLIT):     # a fixed order: the same sums whichever program is last
                acc += tl.load(part_ptr + (2 * j) * n_part + at, mask=mask, other=0.0)
                if GLU:
                    up += tl.load(part_ptr + (2 * j + 1) * n_part + at, mask=mask, other=0.0)
            tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")      # ready for the next launch
    return acc, up, last, rows, cols, mask


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, w3_ptr, part_ptr, ticket_ptr, limit, T, N, K, x_stride, k_split,
                   GLU: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, PF: tl.constexpr, PDL: tl.constexpr = False):
    acc, up, last, rows, cols, mask = product_tile(x_ptr, w_ptr, w3_ptr, part_ptr, ticket_ptr, T, N, K, x_stride,
                                                   k_split, GLU, UPCAST, SPLIT, BM, BN, BK, PDL, PF)
    if last:
        if GLU:      # silu(min(gate, L)) * clamp(up, -L, L), each step rounded as the separate launches stored it
            dt = out_ptr.dtype.element_ty
            gate = tl.minimum(acc.to(dt).to(tl.float32), limit)
            u = tl.minimum(tl.maximum(up.to(dt).to(tl.float32), -limit), limit)
            acc = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * u
        NT = N * tl.num_programs(1)
        out = out_ptr + rows[:, None].to(tl.int64) * NT + (tl.program_id(1) * N + cols)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# the first K step's weights asked of the L2 before the PDL wait (product_tile's PF; compiled kernels only)
PREFETCH = True


def launch_config(T: int, N: int, K: int, groups: int, elsize: int = 2) -> dict:
    """Block sizes: all rows in one tile up to 64 (the weight is read once); BN about the row count (each program
    reads its rows' x once: x traffic / weight traffic = T / BN), made smaller while the grid would not cover the
    132 SMs of an H200; BK a few KB of weight per stage, 4 stages of x + w tiles within ~128 KB of shared memory;
    SPLIT: K cut into that many slices (programs) while the grid stays within one wave (a program an SM), each
    slice at least two BK steps (a few-row product of a wide K is otherwise a few long chains of dependent loads),
    and the fp32 partial sums written and read back (8 * SPLIT * T bytes per output column) at most 1/8 of the
    weight's bytes (2 * K per column). H200, session 8 R2, the shared expert's front half (N 1024, K 2048, bf16, us
    at 8 / 16 / 32 / 64 rows): split into 4 / 4 / 4 / 8 slices 7.4 / 7.5 / 7.9 / 13.4, unsplit 9.3 / 9.3 / 8.4 /
    8.5, the GEMM library's two products + 4 launches 18.1 / 18.2 / 18.4 / 18.3.
    Session 14 (PDL on, 16 calls in a CUDA graph, weights rotating past the L2, us a call; the rule stopped at two
    waves before): R1, the front half at T = 8 4 slices (256 programs) 7.47, 2 (128) 7.01-7.04, 8 8.06; w2 (N
    2048, K 1024) at T = 8 2 slices (256 programs) 5.49 against 3.53-3.55 unsplit at T = 64 (128 programs). R2,
    the shared expert (front half + w2) alone at T = 8 13.29-13.33 -> 10.35-10.42, and as the step runs it, on the
    side stream beside the router and the packed FP4 routed experts (mid-size, a layer): 64.11-64.58 -> 62.28-62.39;
    R3, the same layer at T = 8 65.36-65.41 -> 63.60-63.78, T = 16 78.17-78.29 -> 78.26-78.30, T = 64 (the same
    tiles in both: the noise) 97.33-97.84 against 98.19-98.59.
    Measured and dropped: at T = 64 2 slices (partial sums of 1/4 of the weight's bytes) alone 6.78-6.82 against
    7.69-7.70 (BN 32 with 4 slices 6.64, 8 warps 9.56; R1), but beside the routed experts (R2) 98.47-98.55 against
    96.85-97.16 a layer: nothing gained where the step runs it (the side stream's shorter product does not shorten
    the routed experts beside it)."""
    BM = 16 if T <= 16 else 32 if T <= 32 else 64
    BN = min(64, max(16, triton.next_power_of_2(T)))
    while BN > 16 and groups * triton.cdiv(N, BN) < 132:
        BN //= 2
    BK = min(256, max(16, triton.next_power_of_2(K)))
    while BK > 16 and 4 * (BM + BN) * BK * elsize > 128 * 1024:
        BK //= 2
    tiles = groups * triton.cdiv(N, BN) * triton.cdiv(T, BM)
    split = 1
    while split < 8 and tiles * 2 * split <= 132 and K >= 2 * BK * (2 * split) and 2 * split * T * 32 <= K:
        split *= 2
    return dict(BM=BM, BN=BN, BK=BK, SPLIT=split, num_warps=4, num_stages=4, PF=prefetch_on())


def prefetch_on() -> bool:
    """Whether product_tile asks the L2 for its first weights before the PDL wait (compiled kernels only: PTX)."""
    return PREFETCH and not INTERPRETING


def split_k(K: int, BK: int, SPLIT: int, n_tiles: int, device, site: str, given: torch.Tensor | None = None):
    """-> (k_split, split, tickets) of a split-K launch over n_tiles output tiles: whole BK steps per slice, at
    most SPLIT slices; tickets (`given`, else `backend.tickets` of this site) when split > 1, else None. While a
    CUDA graph is captured before the counters exist, the launch runs unsplit (it needs none)."""
    k_split = triton.cdiv(triton.cdiv(K, SPLIT), BK) * BK
    split = triton.cdiv(K, k_split)
    if split == 1:
        return k_split, 1, None
    tk = given if given is not None else shared_tickets(device, n_tiles, site)
    if tk is None:
        return triton.cdiv(K, BK) * BK, 1, None
    return k_split, split, tk


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, groups: int = 1, glu: tuple | None = None,
                         config: dict | None = None, tickets: torch.Tensor | None = None,
                         site: str = "skinny") -> torch.Tensor:
    """The kernel: same contract as `skinny_linear_torch`. config: launch_config's keys (benchmarks sweep it).
    tickets: int32 zeros, one per output tile, for a split-K launch (default: `backend.tickets` of this site; while
    a CUDA graph is captured before they exist, the launch runs unsplit)."""
    check(x.dim() == 2 and w.dim() == 2, f"skinny_linear: x {tuple(x.shape)} and w {tuple(w.shape)} must be 2-d")
    T, GK = x.shape
    check(GK % groups == 0 and w.shape[0] % groups == 0 and w.shape[1] == GK // groups,
          f"skinny_linear: x {tuple(x.shape)} with w {tuple(w.shape)} in {groups} groups")
    check(x.dtype == w.dtype, f"skinny_linear: x {x.dtype} with w {w.dtype}")
    if glu is not None:
        check(groups == 1 and glu[0].shape == w.shape and glu[0].dtype == w.dtype,
              f"skinny_linear: glu up weight {glu[0].dtype} {tuple(glu[0].shape)} for w {w.dtype} {tuple(w.shape)} "
              f"(want the same shape and dtype, one group)")
    K, N = GK // groups, w.shape[0] // groups
    xs = x if x.stride(1) == 1 else x.contiguous()
    wc = w.contiguous()
    out = empty((T, groups * N), x.dtype, x.device)
    if T == 0 or N == 0:
        return out
    cfg = dict(launch_config(T, N, K, groups, x.element_size()), **(config or {}))
    tiles = (triton.cdiv(N, cfg["BN"]), groups, triton.cdiv(T, cfg["BM"]))
    n_tiles = tiles[0] * tiles[1] * tiles[2]
    k_split, split, tk = split_k(K, cfg["BK"], cfg["SPLIT"], n_tiles, x.device, site, tickets)
    part = out
    if split > 1:
        part = empty((2 * split if glu is not None else 2 * split - 1, T, groups * N), torch.float32, x.device)
        check(tk.dtype == torch.int32 and tk.numel() >= n_tiles,
              f"skinny_linear: tickets {tk.dtype} [{tk.numel()}] for {n_tiles} tiles")
    _skinny_kernel[(tiles[0], tiles[1], tiles[2] * split)](
        xs, wc, out, glu[0].contiguous() if glu is not None else wc, part, out if tk is None else tk,
        float(glu[1]) if glu is not None else 0.0, T, N, K, xs.stride(0), k_split, GLU=glu is not None,
        UPCAST=INTERPRETING, SPLIT=split, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], PF=cfg["PF"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kw())
    return out


# rows up to which the kernel runs on CUDA (above it the GEMM library's tiles win: the weight is re-read per 64 rows).
# Measured and dropped (session 14, H200, us a call in a CUDA graph): the SwiGLU front half by this kernel up to
# 256 rows (the library takes 6 launches there): alone at T = 128 / 256 9.07-9.09 / 10.58-10.59 against the
# library's 18.85-18.86 / 19.92-19.94 (R1), the shared expert 13.48-13.50 / 15.86-15.94 against 24.59-24.60 /
# 25.48-25.63 (R2), but beside the routed experts on the side stream (the step's form) at T = 256 161.69-161.76
# against 161.02-161.04 a layer (R2; two runs of the same tiles differ by up to 0.9 us there, R3): nothing gained.
MAX_ROWS = 64


def skinny_linear(x: torch.Tensor, w: torch.Tensor, groups: int = 1, glu: tuple | None = None,
                  site: str = "skinny") -> torch.Tensor:
    """Dispatch: the kernel on CUDA for up to MAX_ROWS rows of a 16-bit dtype, the twin elsewhere. site: whose
    split-K tickets (`backend.tickets`): launches that may overlap on two streams name different sites."""
    if use_triton(x) and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        return skinny_linear_triton(x, w, groups, glu, site=site)
    return skinny_linear_torch(x, w, groups, glu)
