"""The exact top-k/top-p threshold tau of every row, in a few parallel passes instead of a 32-step bisection.

Two paths, both exact:
- lane path (rows with 0 < top_k <= KMAX, and rows with top-p alone, which try k = KMAX and keep the result when
  those KMAX tokens carry >= p of the row's mass, i.e. the kept set is inside them; two launches, one read of the
  row; `lane_path`): `_lane_max_kernel` per (row, PL lanes of a segment) stores every lane's max z (a lane: the
  16 tokens of the sampling rule's lane, held by one thread: no block reduction at all) and, for top-p-alone
  rows, its mass; `_lane_merge_kernel` per row picks a bound lo with at least k tokens >= lo (`_group_bound`:
  the k-th largest maximum of 16-lane groups, from one 64-bin histogram of 512 values; `_lane_bound`, up to three
  64-bin histograms of the lane maxima, when that leaves more than LCAP = 128 lanes; lo = -inf when the row has
  fewer than k live lanes). Every token >= lo sits in a lane with max >= lo and at least k tokens do, so the
  top-k set is inside those lanes:
  the merge gathers those lanes' tokens ([LCAP, 16], from L2), finds t_k and top-p on the top-k set by all
  pairs (`_block_tau`; a histogram top slice first when there are more than KP = 128 candidates) and, when
  sampling, draws the row's token with the sampling pass's own per-lane operations on those lanes restricted to
  z >= tau (every other lane holds no kept token: it would score -inf in the pass). More than LCAP lanes tied at
  the bound (massive ties) send the row to the exact row-wide bisection and a draw by a loop over the row, in
  the merge.
- histogram path (top_k > KMAX; top-p alone when the KMAX largest carry less than p), below.

Definition (kernels/sampling.py): the top-k set K = {v : fewer than k allowed tokens have z > z_v}; v in K is
kept iff the softmax mass of the tokens with z > z_v is < p times the mass of K (top-p on the renormalised top-k
set); the kept set is {z >= tau}. Rows without filters (and greedy rows, and rows with nothing allowed) get
tau = -inf. K is {z >= t_k}, t_k the k-th largest z, so its mass needs t_k first: the searches below find t_k
(count only), then tau.

Method: bucket z on a fixed grid of width 1/INV_W (bin a = floor(z * INV_W), exact: INV_W is a power of two).
A token in a lower bin than another has a strictly smaller z. Rows with top-k: once the tokens in the top bins
are at least k, every token below those bins is dropped; the candidates are the top bins' tokens (a few dozen
for top_k ~ 100 on real logits). Rows with top-p alone: each bin's mass lies between count x e^(lower edge - m)
and count x e^(upper edge - m), so the bins that may hold the cut are bracketed (the highest bin whose upper
bound of the mass above stays below p * s, down to the first whose lower bound of the mass down to it reaches
p * s: ~1,000-2,000 tokens of a flat 129k row, a few dozen of a peaked one); the candidates are those bins'
tokens, and the gather sums the exact mass above and below them. Four launches:
  1. `_hist_kernel`    (row, chunk): chunk max, chunk sum of exp, histogram of bins below the chunk's top bin;
  2. `_select_kernel`  (row): merge the chunk histograms, pick the candidate bins, each chunk's output offset;
  3. `_gather_kernel`  (row, chunk): write the chunk's candidates (z values) compactly (lane-major order: one
                             scan over lane counts, a running count inside each lane, held by one thread) and
                             (top-p alone) the chunk's mass above and below them;
  4. `_tau_kernel`     (row): tau from the candidates in registers (exact: keep(t) only changes at candidate
                             values, every token above them is kept, every one below them dropped): top-k rows by
                             all pairs or a bisection; top-p-alone rows by `_top_p_cut` (a histogram narrowing
                             to <= KP candidates, then all pairs), after checking the bracket on exact sums.
Passes 1 and 3 read the logits (the second read mostly hits L2 at decode batch sizes); 2 and 4 touch only small
buffers. A row whose candidates exceed CMAX (ties over thousands of tokens, huge |logits|), or whose bracket the
exact sums refute, falls back to the bisection on the fp32 bit pattern (`_bisect_tau`, <= 34 serial passes over
that row): exact, slow, rare. Masses are summed in fp64 (from fp32 weights exp(z - m), one m per row) wherever
p * s decides: a flat row's boundary token holds ~1e-5 of the mass, within fp32 rounding of a long sum
(session 5's kernel, fp32 sums, disagreed with the float64 definition on ~1 flat row in 64; pinned by
tests/kernels/test_threshold.py's boundary test).
Top-p alone on 64 flat rows (V = 129,280), whole sampling call on an H200: 1,255 us when every such row took the
bisection (session 5), 127 us with the bracketed cut (session 6: histogram pass 55, select 8, gather 30, tau 19,
sampling pass 13; the histogram pass is instruction-bound: tl.histogram's ballots, ~75 instructions per token at
512 bins); benchmarks/kernels_sampling.py has the table.
"""
import torch
import triton
import triton.language as tl

from . import rng
from .backend import INTERPRETING, empty, one_wave, pdl_kw, pdl_trigger, pdl_wait

INV_W = 32.0          # bins per unit of z: a token's mass is known to within a factor e^(1/32) from its bin
NB = 512              # bins per chunk histogram (the last one collects everything lower): 16 units of z
CHUNK = 4096          # tokens per (row, chunk) program in passes 1 and 3
CMAX = 4096           # most candidates a row may have on the fast path
SMALL = 256           # candidates up to this many take the short-block variant of the last pass
GATHER_SHAPE = (256, 8)  # candidate pass: (lanes of its [lanes, CHUNK / lanes] blocks, warps); R2, top-p alone on
                         # 64 flat rows, whole tau call: 103.0 us vs 113.6 at (512, 4) (183 registers: 2 programs
                         # per SM), 109.6 at (512, 8), 111.1 at (1024, 8), 113.1 at (256, 4)
HIST_WARPS = 8        # warps of the histogram pass (R1: 53.9 us for top-p-alone flat rows at B=64, instruction-bound:
                      # tl.histogram's ballots cost ~75 instructions per token at 512 bins; R2 whole tau call 113.6
                      # us at 8 warps, 116.1 at 4, 131.6 at 16)
TAU_WARPS = 8         # warps of the tau pass (R2: 113.6 at 8, 130.8 at 4, 113.9 at 16)
SELECT_WARPS = 8      # warps of the select pass (R2: 113.6 at 8, 113.7 at 4, 114.9 at 16)
BIN_LIMIT = 1 << 24   # |z * INV_W| is clamped here (bin numbers and bin edges stay exact in fp32)
KMAX = 64             # rows with 0 < top_k <= KMAX take the candidate path (two launches, one read)
KP = 128              # top-k sets up to this size get top-p by all pairs (larger: a bisection)
HB = 64               # bins of the merge's top-slice histogram (many candidates: one histogram, not halvings)
HB_CUT = 512          # bins of the tau pass's histogram narrowing a top-p-alone row's candidates to <= KP


# Programmatic dependent launch (backend.pdl_kw) of the per-row kernel after a pass: the sampling finish after
# the sampling pass, the top-k merge after the lane maxima, the top-p rejection chain. Session 9's R2 (H200, B=64,
# each twice, us, off -> on): T=1 11.0 / 11.8 -> 10.7 / 10.7; T=0.7 + mask 13.4 / 14.5 -> 13.2 / 14.4; top-k50
# p0.9 28.7 / 28.0 -> 27.5 / 27.5; top-p0.95 peaked 24.6 / 26.0 -> 23.7 / 24.6; B=256: T=1 34.5 -> 33.5, top-k
# 74.5 -> 74.6. CUDA graphs capture the launches. The speculative step's chain measured no gain (48.7 / 49.9 ->
# 49.4 / 49.8), so its own kernels (stats, accept) keep plain launches; its filtered rows' lane path uses PDL.
# Session 12: the passes themselves (the sampling pass, the lane maxima) are PDL-launched too, waiting first (only
# their launch overlaps the kernel before). R2 (B=64, twice each, us, HEAD -> now; everything PDL off in the same
# run): T=1 11.1 / 11.1 -> 10.6 / 11.0 (11.8 / 11.9); top-k50 p0.9 21.2 / 21.2 -> 21.0 / 21.1 (22.4 / 22.1). The
# sampling pass before the rejection chain too since session 13 (kernels/sampling.py beside its launch).


@triton.jit
def load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK: tl.constexpr):
    """One block of z = logit / T (fp32), -inf for padding and banned tokens. row: int64."""
    ok = cols < V
    x = tl.load(logits_ptr + row * V + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        w = tl.load(bitmask_ptr + mrow * bitmask_stride + cols // 32, mask=ok & (mrow >= 0), other=-1)
        x = tl.where(((w >> (cols % 32)) & 1) != 0, x, float("-inf"))
    return x * inv_t


@triton.jit
def _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr):
    """(does this row need the histogram path, k (V + 1 when off), p): rows with filters that the candidate path
    left to it (todo == -3)."""
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    filt = (((top_k > 0) & (top_k < V)) | (top_p < 1.0)) & (tl.load(greedy_ptr + row) == 0)
    filt = filt & (tl.load(todo_ptr + row) == -3)
    return filt, tl.where(top_k > 0, top_k, V + 1), top_p


@triton.jit
def _bin(z, INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr):
    """floor(z * INV_W) as int32, clamped to +-BIN_LIMIT (monotone in z; -inf goes to -BIN_LIMIT)."""
    x = tl.minimum(tl.maximum(z * INV_W, -BIN_LIMIT), BIN_LIMIT)
    return tl.floor(x).to(tl.int32)


@triton.jit
def _hist_kernel(logits_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr, bitmask_ptr, mask_rows_ptr,
                 bitmask_stride, V, n_chunks, cmax_ptr, csum_ptr, cbin_ptr, hist_ptr,
                 HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr, INV_W: tl.constexpr,
                 BIN_LIMIT: tl.constexpr):
    """Program (row, chunk): chunk max, sum exp(z - chunk max), the chunk's top bin and allowed tokens, and counts
    per bin below the top bin (bin i = top bin - i; bin NB-1 collects the rest). Rows without filters write
    nothing (nobody reads it)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr)
    if filt:
        mrow = -1
        if HAS_MASK:
            mrow = tl.load(mask_rows_ptr + row)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        z = load_z(logits_ptr, row, cols, V, tl.load(inv_t_ptr + row), bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        live = z > float("-inf")
        cm = tl.max(z, 0)
        ref = tl.where(cm > float("-inf"), cm, 0.0)
        cs = tl.sum(tl.where(live, tl.exp(z - ref), 0.0), 0)
        top = _bin(cm, INV_W, BIN_LIMIT)
        rel = tl.minimum(top - _bin(z, INV_W, BIN_LIMIT), NB - 1)
        hist = tl.histogram(rel, NB, mask=live)
        o = row * n_chunks + chunk
        tl.store(cmax_ptr + o, cm)
        tl.store(csum_ptr + o, cs)
        tl.store(cbin_ptr + 2 * o, top)
        tl.store(cbin_ptr + 2 * o + 1, tl.sum(live.to(tl.int32), 0))
        tl.store(hist_ptr + o * NB + tl.arange(0, NB), hist)


@triton.jit
def _select_kernel(greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr, V, n_chunks, cmax_ptr, csum_ptr, cbin_ptr, hist_ptr,
                   m_ptr, s_ptr, low_ptr, ncand_ptr, offset_ptr,
                   NCP: tl.constexpr, NB: tl.constexpr, INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr,
                   CMAX: tl.constexpr):
    """Program (row): row max m and sum s; the candidate bins [low, high] (absolute bin numbers); candidates per
    chunk -> output offsets. ncand: -2 = no filtering (tau = -inf), -1 = fall back to the bisection, >= 1 =
    candidates on the fast path.
    Rows with top-k: every bin from the top down to the one where the count reaches k (K, whose mass
    renormalises top-p, is inside). Rows with top-p alone: only the bins that may hold the cut, bracketed by
    each bin's mass bounds (count x e^(lower edge - m), count x e^(upper edge - m)): the highest bin whose upper
    bound of the mass strictly above stays below p * s, down to the first bin where the lower bound of the mass
    down to it reaches p * s. The gather then sums the exact mass above and below those bins, and the tau pass
    checks the bracket on exact sums (a wrong bracket, e.g. from rounding, sends the row to the fallback)."""
    row = tl.program_id(0).to(tl.int64)
    filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr)
    ncand = -2
    if filt:
        c = tl.arange(0, NCP)
        okc = c < n_chunks
        cm = tl.load(cmax_ptr + row * n_chunks + c, mask=okc, other=float("-inf"))
        cs = tl.load(csum_ptr + row * n_chunks + c, mask=okc, other=0.0)
        live = cm > float("-inf")
        top = tl.load(cbin_ptr + 2 * (row * n_chunks + c), mask=okc & live, other=-BIN_LIMIT - 1)   # no overflow
        n_row = tl.sum(tl.load(cbin_ptr + 2 * (row * n_chunks + c) + 1, mask=okc & live, other=0), 0)
        m = tl.max(cm, 0)
        if m > float("-inf"):
            s = tl.sum(tl.where(live, cs * tl.exp(cm - m), 0.0), 0)
            mbin = tl.max(top, 0)
            # row bin b (absolute bin mbin - b) is chunk c's local bin b - (mbin - top_c); exact for b <= NB - 2
            b = tl.arange(0, NB)
            local = b[None, :] - (mbin - top)[:, None]
            ok2 = live[:, None] & (local >= 0) & (local < NB - 1)
            h = tl.load(hist_ptr + (row * n_chunks + c)[:, None] * NB + local, mask=ok2, other=0)
            counts = tl.sum(h, 0)                                           # [NB]; bin NB-1 stays 0
            cum_count = tl.cumsum(counts, 0)
            # with top-k the candidates must hold all of K (its mass renormalises top-p): stop on the count only
            # the first bin down to which every allowed token is counted (NB: some lie past the histogram): the
            # candidates may stop there whatever k or p asks (rows whose mask leaves few tokens)
            j_all = tl.min(tl.where((cum_count >= n_row) & (b < NB - 1), b, NB), 0)
            j0 = tl.min(tl.where((cum_count >= top_k) & (b < NB - 1), b, NB), 0)
            j_first = 0
            if top_k >= V:
                # top-p alone: mass bounds of each bin (its tokens have z in [edge, edge + 1/INV_W), and <= m)
                edge = (mbin - b).to(tl.float32) * (1.0 / INV_W) - m
                low_mass = counts.to(tl.float32) * tl.exp(edge)
                up_mass = counts.to(tl.float32) * tl.exp(tl.minimum(edge + 1.0 / INV_W, 0.0))
                lim = top_p * s
                above_up = tl.cumsum(up_mass, 0) - up_mass                  # upper bound of the mass above bin b
                j_first = tl.sum((above_up < lim * 0.9999).to(tl.int32), 0) - 1
                j0 = tl.min(tl.where((tl.cumsum(low_mass, 0) >= lim * 1.0001) & (b < NB - 1), b, NB), 0)
            j0 = tl.minimum(j0, j_all)
            in_c = (b <= j0) & (b >= j_first)
            ncand = tl.sum(tl.where(in_c, counts, 0), 0)
            fast = (j0 < NB) & (ncand <= CMAX) & (mbin < BIN_LIMIT - 1) & (mbin - NB > -BIN_LIMIT)
            if fast:
                per_chunk = tl.sum(tl.where(in_c[None, :], h, 0), 1)       # [NCP]
                tl.store(offset_ptr + row * n_chunks + c, tl.cumsum(per_chunk, 0) - per_chunk, mask=okc)
                tl.store(low_ptr + 2 * row, mbin - j0)
                # rows with top-k: every bin above low (no outside mass needed: high is past every bin)
                tl.store(low_ptr + 2 * row + 1, tl.where(top_k >= V, mbin - j_first, BIN_LIMIT + 1))
            else:
                ncand = -1
            tl.store(m_ptr + row, m)
            tl.store(s_ptr + row, s)
        else:
            ncand = -2                                                      # nothing allowed: tau = -inf
    tl.store(ncand_ptr + row, ncand)


def _words_asm(vec: int) -> str:
    """PTX for `_load_words` over `vec` packed elements (operands: vec outputs, then vec addresses, vec word
    offsets, vec predicates): element 0 loads its word; every other element copies element 0's word when its word
    offset is the same and loads its own otherwise. Packed elements are consecutive registers of one thread, and
    which tokens those are depends on the layout Triton picks: side-by-side lanes of one word when the logits
    load is vectorised ([VEC, 1] per thread), but lanes 64 apart (other words) when it is not (a vocabulary that
    is not a multiple of 16, say). The first form of this asm (session 4) copied element 0's word blindly, so
    masked rows drew wrong tokens at V = 9,000 and 1,000 on an H200 while the interpreter (tl.load) passed."""
    o, a, w, p = 0, vec, 2 * vec, 3 * vec
    lines = [f"setp.ne.b32 p, ${p}, 0;", f"mov.b32 ${o}, -1;", f"@p ld.global.nc.b32 ${o}, [${a}];"]
    for i in range(1, vec):
        lines += [f"mov.b32 ${o + i}, ${o};", f"setp.ne.and.b32 q, ${w + i}, ${w}, p;",
                  f"@q ld.global.nc.b32 ${o + i}, [${a + i}];"]
    return "{ .reg .pred p, q; " + " ".join(lines) + " }"


WORDS_ASM_4 = tl.constexpr(_words_asm(4))
WORDS_ASM_2 = tl.constexpr(_words_asm(2))


@triton.jit
def _load_words(bitmask_ptr, woff, ok, VEC: tl.constexpr, FAST: tl.constexpr):
    """The bitmask words of a [lanes, LW] block (woff: each token's word offset from bitmask_ptr, int32; ok: a
    scalar, False = unmasked row: all bits set). On a GPU the VEC elements a thread packs share one load when they
    sit in one word (lanes side by side: a plain tl.load would issue VEC loads of the same address), whatever the
    layout (`_words_asm`); the interpreter loads per element."""
    wptr = bitmask_ptr + woff
    if FAST and VEC == 4:
        addr = wptr.to(tl.int64, bitcast=True)
        pred = ((woff == woff) & ok).to(tl.int32)
        return tl.inline_asm_elementwise(WORDS_ASM_4, "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r",
                                         [addr, woff.to(tl.int32), pred], dtype=tl.int32, is_pure=True, pack=4)
    elif FAST and VEC == 2:
        addr = wptr.to(tl.int64, bitcast=True)
        pred = ((woff == woff) & ok).to(tl.int32)
        return tl.inline_asm_elementwise(WORDS_ASM_2, "=r,=r,l,l,r,r,r,r", [addr, woff.to(tl.int32), pred],
                                         dtype=tl.int32, is_pure=True, pack=2)
    else:
        return tl.load(wptr, mask=ok, other=-1)


@triton.jit
def _sparse_block(ptrs, bitmask_ptr, lane, k, pos, start, V, mrow, bitmask_stride, LANES: tl.constexpr):
    """(masked rows only) the mask words first, then only the allowed tokens' logits (a sector whose tokens are all
    banned is never read: grammar masks ban whole ranges); per-token predicates: one lane per thread."""
    woff = (start + k[None, :] * LANES) // 32 + lane[:, None] // 32
    ok = pos < V - start
    words = tl.load(bitmask_ptr + mrow * bitmask_stride + woff, mask=(mrow >= 0) & ok, other=-1)
    allowed = ok & ((words & (1 << (lane % 32))[:, None]) != 0)
    return tl.load(ptrs, mask=allowed, other=float("-inf")).to(tl.float32)


@triton.jit
def _dense_block(ptrs, bitmask_ptr, lane, k, pos, start, V, mrow, bitmask_stride, HAS_MASK: tl.constexpr,
                 FULL: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, FAST: tl.constexpr):
    """Every token's logit (16 / 8 / 4-byte loads), then the mask bits (words loaded once per thread and k)."""
    if FULL:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=pos < V - start, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        # token start + pos sits in word (start + pos) // 32 at bit pos % 32 (start, LANES multiples of 32);
        # the offsets keep dim 0 first in contiguity so that the words load takes the logits' layout
        woff = (start + k[None, :] * LANES) // 32 + lane[:, None] // 32
        if FULL and VEC == 1:
            # one lane per thread: every token loads its word unpredicated (from row 0 for an unmasked row, whose
            # words the OR sets to all ones): a predicated load needs its default moved in first, one more
            # instruction per token (the bit test takes the OR in its LOP3). Session 16 R1 (H200, B=256, T=0.7 +
            # random masks, 128x4, with ln S_g by the hardware log2, HEAD in the same run, us): 39.50 / 39.65
            # against 40.36 / 40.74; B=64 at 64x2 no change (13.41 / 14.70 against 13.40 / 14.61)
            words = tl.load(bitmask_ptr + tl.maximum(mrow, 0) * bitmask_stride + woff) | tl.where(mrow >= 0, 0, -1)
        elif FULL:
            words = _load_words(bitmask_ptr + mrow * bitmask_stride, woff, mrow >= 0, VEC, FAST)
        else:
            words = tl.load(bitmask_ptr + mrow * bitmask_stride + woff, mask=(mrow >= 0) & (pos < V - start),
                            other=-1)
        x = tl.where((words & (1 << (lane % 32))[:, None]) != 0, x, float("-inf"))
    return x


@triton.jit
def lane_block(logits_ptr, bitmask_ptr, row, start, V, mrow, bitmask_stride, HAS_MASK: tl.constexpr,
               FULL: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr, sub, VEC: tl.constexpr,
               FAST: tl.constexpr, MASK_FIRST: tl.constexpr = False):
    """Raw logits (fp32) of the tokens start + k * LANES + l, l = sub * PL .. sub * PL + PL - 1, as a [PL, LW]
    block: lanes along dim 0 (contiguous in memory, VEC side by side per thread: 16 / 8 / 4-byte loads, spread
    over threads), a lane's LW tokens along dim 1 (held by one thread, so per-lane reductions need no
    communication); -inf for padding and banned tokens. FULL: no token is past V (no bounds checks).
    MASK_FIRST (masked rows): `_sparse_block` (mask words first). Returns (lane, pos, x): lane and pos counted
    from start."""
    lane = sub * PL + tl.arange(0, PL)
    k = tl.arange(0, LW)
    pos = lane[:, None] + k[None, :] * LANES
    pos = tl.max_contiguous(tl.multiple_of(pos, [VEC, 1]), [VEC, 1])
    ptrs = logits_ptr + row * V + start + pos
    if MASK_FIRST:
        x = _sparse_block(ptrs, bitmask_ptr, lane, k, pos, start, V, mrow, bitmask_stride, LANES)
    else:
        x = _dense_block(ptrs, bitmask_ptr, lane, k, pos, start, V, mrow, bitmask_stride, HAS_MASK, FULL, LANES,
                         VEC, FAST)
    return lane, pos, x


@triton.jit
def lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK: tl.constexpr,
                 FULL: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr, sub,
                 VEC: tl.constexpr, FAST: tl.constexpr):
    """`lane_block` as z = x / T. Returns (z, position in the block)."""
    lane, pos, x = lane_block(logits_ptr, bitmask_ptr, row, start, V, mrow, bitmask_stride, HAS_MASK, FULL, LANES, LW,
                              PL, sub, VEC, FAST)
    return x * inv_t, pos


@triton.jit
def row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, start, V, bitmask_stride,
                HAS_MASK: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr, sub,
                VEC: tl.constexpr, FAST: tl.constexpr):
    """`lane_block_z` of row `row` from `start`, with the row's mask row and 1/T loaded here; the bounds-checked
    form only for the block that reaches past V."""
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    inv_t = tl.load(inv_t_ptr + row)
    if start + LANES * LW <= V:
        z, pos = lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK,
                              True, LANES, LW, PL, sub, VEC, FAST)
    else:
        z, pos = lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK,
                              False, LANES, LW, PL, sub, VEC, FAST)
    return z, pos


@triton.jit
def _gather_kernel(logits_ptr, inv_t_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_chunks, low_ptr,
                   ncand_ptr, offset_ptr, cand_ptr, m_ptr, outside_ptr, HAS_MASK: tl.constexpr, LANES: tl.constexpr,
                   LW: tl.constexpr, INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr, CMAX: tl.constexpr,
                   VEC: tl.constexpr, FAST: tl.constexpr):
    """Program (row, chunk): the chunk's candidates (z in a bin of [low, high]), written compactly at the chunk's
    offset in lane-major order (one scan over the lanes' counts, then a running count inside each lane, held by
    one thread), and the chunk's mass sum exp(z - m) (m: the row max) above the candidate bins and below them,
    summed in fp64 (outside[row, chunk] = (above, below)): the tau pass needs the exact mass around the
    candidates when top-p alone gathered only the bins that may hold the cut."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(ncand_ptr + row) > 0:
        z, pos = row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, chunk * (LANES * LW), V,
                             bitmask_stride, HAS_MASK, LANES, LW, LANES, 0, VEC, FAST)
        live = z > float("-inf")
        # bin(z) > high  <=>  z >= (high + 1) / INV_W, bin(z) < low  <=>  z < low / INV_W: the edges are exact
        # (INV_W is a power of two) and the fast path keeps every bin inside the clamp, so two compares per token
        high = tl.load(low_ptr + 2 * row + 1)
        above = live & (z >= (high + 1).to(tl.float32) * (1.0 / INV_W))
        below = live & (z < tl.load(low_ptr + 2 * row).to(tl.float32) * (1.0 / INV_W))
        is_c = (live & ~above & ~below).to(tl.int32)
        per_lane = tl.sum(is_c, 1)
        lane_start = tl.cumsum(per_lane, 0) - per_lane
        at = tl.load(offset_ptr + row * n_chunks + chunk) + lane_start[:, None] + tl.cumsum(is_c, 1) - 1
        tl.store(cand_ptr + row * CMAX + at, z, mask=is_c != 0)
        if high <= BIN_LIMIT:                               # top-p alone (rows with top-k need no outside mass)
            e = tl.exp(z - tl.load(m_ptr + row))
            # in-thread fp32 sums of a lane's LW terms, then fp64 across the lanes
            o = 2 * (row * n_chunks + chunk)
            tl.store(outside_ptr + o, tl.sum(tl.sum(tl.where(above, e, 0.0), 1).to(tl.float64), 0))
            tl.store(outside_ptr + o + 1, tl.sum(tl.sum(tl.where(below, e, 0.0), 1).to(tl.float64), 0))


@triton.jit
def _ordered(x):
    """int32 bits of an fp32 -> int32 key with the same order (an involution: apply again to go back)."""
    return tl.where(x >= 0, x, x ^ 0x7FFFFFFF)


@triton.jit
def _count_mass_above(t, z, e, logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, m,
                      HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, FROM_ROW: tl.constexpr):
    """(count, sum of exp(z - m)) of the values > t: of block z (weights e) or, FROM_ROW, of the row in memory
    (one pass over it, the sums in fp64: ~127 terms per accumulator at V = 129,280, whose fp32 rounding, ~1e-6 of
    the mass, would decide flat rows' margins)."""
    if FROM_ROW:
        cnt = tl.zeros([BLOCK], tl.int32)
        mass = tl.zeros([BLOCK], tl.float64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            zr = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
            above = zr > t
            cnt += above.to(tl.int32)
            mass += tl.where(above, tl.exp(zr - m), 0.0).to(tl.float64)
        return tl.sum(cnt, 0), tl.sum(mass, 0)
    else:
        above = z > t
        return tl.sum(above.to(tl.int32), 0), tl.sum(tl.where(above, e, 0.0), 0)


@triton.jit
def _bisect(z, e, zmin, m, top_k, top_p, s, base, logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride,
            HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, FROM_ROW: tl.constexpr):
    """Smallest t among the values (block z with weights e, or FROM_ROW the row in memory) with keep(t):
    count(z > t) < k and base + mass(z > t) < p * s (s: the mass p is relative to; base: the mass of larger
    values outside the block); keep is monotone in t and true at t = m. A bisection on the ordered fp32 bits
    between zmin and m (<= 32 steps, each a count: two block reductions, or a pass over the row)."""
    cnt, mass = _count_mass_above(zmin, z, e, logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, m,
                                  HAS_MASK, BLOCK, FROM_ROW)
    tau = zmin
    if (cnt >= top_k) | (base + mass >= _p_limit(top_p, s)):
        lo = _ordered(zmin.to(tl.int32, bitcast=True)).to(tl.int64)      # keep(lo) is false
        hi = _ordered(m.to(tl.int32, bitcast=True)).to(tl.int64)         # keep(hi) is true
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            t = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
            cnt, mass = _count_mass_above(t, z, e, logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, m,
                                          HAS_MASK, BLOCK, FROM_ROW)
            if (cnt < top_k) & (base + mass < _p_limit(top_p, s)):
                hi = mid
            else:
                lo = mid
        tau = _ordered(hi.to(tl.int32)).to(tl.float32, bitcast=True)
    return tau


@triton.jit
def _p_limit(top_p, s):
    """The mass that strictly larger tokens must stay below: p * s, unbounded when p >= 1 (top-p off, even where
    float masses saturate on huge logit gaps)."""
    return tl.where(top_p >= 1.0, float("inf"), top_p * s)


@triton.jit
def _mass_at_least(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, t, m, HAS_MASK: tl.constexpr,
                   BLOCK: tl.constexpr):
    """sum of exp(z - m) over the row's tokens with z >= t (fp64 sums, as `_count_mass_above`)."""
    mass = tl.zeros([BLOCK], tl.float64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        mass += tl.where(z >= t, tl.exp(z - m), 0.0).to(tl.float64)
    return tl.sum(mass, 0)


@triton.jit
def _bisect_tau(logits_ptr, row, V, inv_t, top_k, top_p, bitmask_ptr, mrow, bitmask_stride,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """The fallback: the row max, then bisections on the ordered fp32 bits (<= 32 passes each): t_k (count only)
    when top-k filters, then tau; the mass p is relative to (the row's, or K's) is summed by the same formula as
    the masses compared with it (exp(z - m) with the final m, fp64 sums). Session 5's fallback summed the row's
    mass online (rescaled at each new max) and the compared masses in fp32: ~1e-6 apart, while a flat row's
    boundary token holds ~1e-5 of the mass, so 1 row in 64 kept one token more or less than the definition."""
    m = float("-inf")
    zmin = float("inf")
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        m = tl.maximum(m, tl.max(z, 0))
        zmin = tl.minimum(zmin, tl.min(tl.where(z > float("-inf"), z, float("inf")), 0))
    tau = float("-inf")
    if m > float("-inf"):
        sk = _mass_at_least(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, zmin, m, HAS_MASK, BLOCK)
        if top_k < V:                                   # K = {z >= t_k}: its mass renormalises top-p
            t_k = _bisect(zmin, zmin, zmin, m, top_k, 2.0, sk, 0.0, logits_ptr, row, V, inv_t, bitmask_ptr, mrow,
                          bitmask_stride, HAS_MASK, BLOCK, True)
            sk = _mass_at_least(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, t_k, m, HAS_MASK,
                                BLOCK)
        tau = _bisect(zmin, zmin, zmin, m, top_k, top_p, sk, 0.0, logits_ptr, row, V, inv_t, bitmask_ptr, mrow,
                      bitmask_stride, HAS_MASK, BLOCK, True)
    return tau


@triton.jit
def _bisect_candidates(cand_ptr, n, m, s, top_k, top_p, V, BLOCK: tl.constexpr):
    """tau from the n candidates held in registers: keep(t) is exact for t >= the smallest candidate (every other
    token is smaller), it only changes at candidate values, and it is true at t = m. With top-k, t_k first (count
    only) and the mass of K = {z >= t_k}; then the bisection for tau."""
    i = tl.arange(0, BLOCK)
    z = tl.load(cand_ptr + i, mask=i < n, other=float("-inf"))
    e = tl.where(z > float("-inf"), tl.exp(z - m), 0.0)
    zmin = tl.min(tl.where(z > float("-inf"), z, float("inf")), 0)
    sk = s
    if top_k < V:
        t_k = _bisect(z, e, zmin, m, top_k, 2.0, 1.0, 0.0, cand_ptr, 0, V, 1.0, cand_ptr, 0, 0, False, BLOCK, False)
        sk = tl.sum(tl.where(z >= t_k, e, 0.0), 0)
    return _bisect(z, e, zmin, m, top_k, top_p, sk, 0.0, cand_ptr, 0, V, 1.0, cand_ptr, 0, 0, False, BLOCK, False)


@triton.jit
def _pairs_above(ptr, n, m, N: tl.constexpr, JB: tl.constexpr):
    """(z [N], count [N], mass [N]): the n values at ptr (-inf padding) and, for each, the count and the sum of
    exp(z - m) of the values strictly larger: all pairs, JB columns at a time (independent blocks, no serial
    search)."""
    i = tl.arange(0, N)
    z = tl.load(ptr + i, mask=i < n, other=float("-inf"))
    cnt = tl.zeros([N], tl.int32)
    mass = tl.zeros([N], tl.float32)
    for j0 in tl.static_range(0, N, JB):
        j = j0 + tl.arange(0, JB)
        zj = tl.load(ptr + j, mask=j < n, other=float("-inf"))
        ej = tl.where(zj > float("-inf"), tl.exp(zj - m), 0.0)
        gt = zj[None, :] > z[:, None]
        cnt += tl.sum(gt.to(tl.int32), 1)
        mass += tl.sum(tl.where(gt, ej[None, :], 0.0), 1)
    return z, cnt, mass


@triton.jit
def _compact_pairs(z, sel, n_sel, m, scratch_ptr, KP: tl.constexpr, JB: tl.constexpr):
    """`_pairs_above` on the n_sel <= KP selected entries of block z, compacted into scratch_ptr first (the caller
    puts a barrier after its last use of the result, before the scratch is written again)."""
    at = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(scratch_ptr + at, z, mask=sel)
    tl.debug_barrier()                              # the block's stores before its loads
    return _pairs_above(scratch_ptr, n_sel, m, KP, JB)


@triton.jit
def _direct_candidates(cand_ptr, n, m, s, top_k, top_p, V, BLOCK: tl.constexpr, JB: tl.constexpr):
    """tau from n <= BLOCK candidates by the definition, without a serial search: for every candidate v the count
    and the mass of candidates with z > z_v (blocks of JB columns of the all-pairs comparison, independent of
    each other); K = the candidates with count < k (all of K is among them when top-k filters; otherwise s is
    the row's whole mass); kept iff in K and mass < p * mass(K); tau = the smallest kept candidate (the largest
    one is always kept). Exact on the candidates for the same reason as _bisect_candidates."""
    z, cnt, mass = _pairs_above(cand_ptr, n, m, BLOCK, JB)
    live = z > float("-inf")
    in_k = (cnt < top_k) & live
    sk = s
    if top_k < V:
        sk = tl.sum(tl.where(in_k, tl.exp(z - m), 0.0), 0)
    keep = in_k & (mass < _p_limit(top_p, sk))
    return tl.min(tl.where(keep, z, float("inf")), 0)


@triton.jit
def _top_p_cut(cand_ptr, n, m, base, below, top_p, scratch_ptr, BLOCK: tl.constexpr, KP: tl.constexpr,
               JB: tl.constexpr, HB: tl.constexpr, HIST: tl.constexpr, s_row=-1.0):
    """(tau, ok) for top-p alone from the n candidates at cand_ptr (the tokens of the bins that may hold the cut),
    base / below: the exact mass (sum exp(z - m), fp64) of the row's tokens above / below them. The row's mass is
    s = base + below + the candidates' mass, or s_row when that is >= 0 (the rejection finish: its proposals were
    judged against it); v is kept iff base + mass(candidates > z_v) < p * s.
    Many candidates (> KP) are narrowed first: a histogram of HB bins over their value range, each bin's mass
    bounded by its count and its edges, brackets the cut the same way the select did (HIST: the block is large
    enough for tl.histogram); the candidates above the bracket join `base` by one masked sum. The last <= KP
    by all pairs (no serial search); more (ties, dense bins): a bisection on the block.
    ok: the cut lies inside the candidates (base < p * s <= base + their mass), checked on the exact sums, so a
    bracket that rounding made wrong sends the row to the fallback instead of giving a wrong tau."""
    i = tl.arange(0, BLOCK)
    z = tl.load(cand_ptr + i, mask=i < n, other=float("-inf"))
    live = z > float("-inf")
    e = tl.where(live, tl.exp(z - m), 0.0)
    total = tl.sum(e.to(tl.float64), 0)
    s = tl.where(s_row >= 0, s_row, base + below + total)
    lim = top_p * s
    ok = (base < lim) & (base + total >= lim)
    sel = live
    base2 = base
    n_sel = n
    if HIST & (n > KP):
        zmax = tl.max(z, 0)
        zmin = tl.min(tl.where(live, z, float("inf")), 0)
        width = tl.where(zmax > zmin, (zmax - zmin) * (1.0 / HB), 1.0)
        b = tl.where(live, tl.minimum(tl.floor((zmax - tl.where(live, z, zmax)) / width), HB - 1.0), HB - 1.0)
        b = b.to(tl.int32)
        cnt = tl.histogram(b, HB, mask=live).to(tl.float32)
        top_edge = zmax - tl.arange(0, HB).to(tl.float32) * width - m
        up = cnt * tl.exp(tl.minimum(top_edge, zmax - m))
        low = cnt * tl.exp(top_edge - width)
        j = tl.arange(0, HB)
        j_first = tl.maximum(tl.sum((base + (tl.cumsum(up, 0) - up) < lim * 0.9999).to(tl.int32), 0) - 1, 0)
        j_last = tl.min(tl.where(base + tl.cumsum(low, 0) >= lim * 1.0001, j, HB - 1), 0)
        sel = live & (b >= j_first) & (b <= j_last)
        base2 = base + tl.sum(tl.where(live & (b < j_first), e, 0.0).to(tl.float64), 0)
        n_sel = tl.sum(sel.to(tl.int32), 0)
    if n_sel <= KP:
        zi, cnt_gt, mass = _compact_pairs(z, sel, n_sel, m, scratch_ptr, KP, JB)
        keep = (zi > float("-inf")) & (base2 + mass.to(tl.float64) < lim)
        tau = tl.min(tl.where(keep, zi, float("inf")), 0)
        ok = ok & (base2 < lim) & (base2 + tl.sum(tl.where(sel, e, 0.0).to(tl.float64), 0) >= lim)
        tl.debug_barrier()                              # every load of the scratch before a later reuse
    else:
        zmin = tl.min(tl.where(live, z, float("inf")), 0)
        tau = _bisect(z, e, zmin, m, 2147483647, top_p, s, base, cand_ptr, 0, 0, 1.0, cand_ptr,
                      0, 0, False, BLOCK, False)
    return tau, ok


@triton.jit
def _tau_kernel(logits_ptr, tau_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr, bitmask_ptr,
                mask_rows_ptr, bitmask_stride, V, n_chunks, m_ptr, s_ptr, ncand_ptr, cand_ptr, outside_ptr,
                scratch_ptr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, CMAX: tl.constexpr, SMALL: tl.constexpr,
                NCP: tl.constexpr, KP: tl.constexpr, HB: tl.constexpr):
    """Program (row) of the histogram path: tau from the candidates (fast path) or from the bisection (fallback:
    the select's, or a top-p bracket that the exact sums refuted, reported as ncand = -1). Rows the candidate
    path solved keep its tau."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(todo_ptr + row) == -3:
        filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr)
        ncand = tl.load(ncand_ptr + row)
        tau = float("-inf")
        m = tl.load(m_ptr + row)
        if ncand > 0:
            if top_k >= V:                              # top-p alone: the bracketed bins and the exact sums around
                c = tl.arange(0, NCP)
                o = 2 * (row * n_chunks + c)
                outside_base = tl.sum(tl.load(outside_ptr + o, mask=c < n_chunks, other=0.0), 0)
                outside_below = tl.sum(tl.load(outside_ptr + o + 1, mask=c < n_chunks, other=0.0), 0)
                tau, ok = _top_p_cut(cand_ptr + row * CMAX, ncand, m, outside_base, outside_below, top_p,
                                     scratch_ptr + row * KP, CMAX, KP, 32, HB, CMAX >= 1024)
                if not ok:
                    ncand = -1
                    tl.store(ncand_ptr + row, -1)
            elif ncand <= SMALL:                        # the usual case (top_k ~ 50): all pairs, no serial search
                tau = _direct_candidates(cand_ptr + row * CMAX, ncand, m, tl.load(s_ptr + row), top_k, top_p, V,
                                         SMALL, 32)
            else:
                tau = _bisect_candidates(cand_ptr + row * CMAX, ncand, m, tl.load(s_ptr + row), top_k, top_p, V,
                                         CMAX)
        if ncand == -1:
            mrow = -1
            if HAS_MASK:
                mrow = tl.load(mask_rows_ptr + row)
            tau = _bisect_tau(logits_ptr, row, V, tl.load(inv_t_ptr + row), top_k, top_p, bitmask_ptr, mrow,
                              bitmask_stride, HAS_MASK, BLOCK)
        tl.store(tau_ptr + row, tau)


# ---------------------------------------------------------------------------------------------- candidate path
@triton.jit
def exp2_w(x, FAST: tl.constexpr):
    """2**x for the lane weights. FAST (GPUs): one MUFU.EX2 with denormal results flushed to zero (PTX
    ex2.approx.ftz; plain exp2 adds a range check and two scalings per token). Flushing cannot change a draw: a
    weight below 2**-126 sits in a lane whose largest weight is ~1, so it moves no running sum and no mass."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _below(target, s):
    """min(target, the float just below s) for s > 0 (bits of positive floats order like the floats), so that
    some lane's running sum (the largest, s) always exceeds it."""
    return tl.minimum(target.to(tl.int32, bitcast=True), s.to(tl.int32, bitcast=True) - 1).to(tl.float32,
                                                                                                bitcast=True)


@triton.jit
def lane_pick(w, gid, key, LW: tl.constexpr):
    """Inverse-CDF draw inside every lane of a [lanes, LW] block of weights >= 0 (each lane held by one thread:
    no communication): (S [lanes], k [lanes]) = the lane mass and the first k whose running sum exceeds u * S
    (u = uniform(key, U_ID + gid), the target kept below S). Twin: lane_draw_torch.
    A lane's running sum is accumulated in-thread in k order, so it never decreases and it only grows at a w > 0:
    S is its last entry (= the largest running sum at a kept token, the twin's S), and the first entry above
    the target is the count of entries at or below it, a token with w > 0 (the target is > 0 when S > 0).
    ~3 instructions per token (add, compare, count)."""
    cdf = tl.cumsum(w, 1)
    k = tl.arange(0, LW)[None, :]
    s = tl.max(tl.where(k == LW - 1, cdf, float("-inf")), 1)              # the last entry: a register pick
    target = _below(rng.uniform_tl(key, gid + 1073741824) * s, s)            # U_ID + g
    return s, tl.sum((cdf <= target[:, None]).to(tl.int32), 1)


@triton.jit
def lane_score(m, s, key, gid, FAST: tl.constexpr):
    """M_g + ln S_g + G_g per lane (G_ID + g), -inf for an empty lane. FAST (GPUs): ln S_g by the hardware log2
    as the Gumbel noise's logs (rng._log2: ~2**-22 absolute in log2 for S_g >= ~1, as here; the accurate log is ~20
    instructions a lane)."""
    g = rng.gumbel_tl(key, gid + 1610612736, FAST)                          # G_ID + g
    if FAST:
        ln_s = rng._log2(tl.maximum(s, 1e-30), FAST) * 0.6931471805599453
    else:
        ln_s = tl.log(tl.maximum(s, 1e-30))
    return tl.where(s > 0, m + ln_s + g, float("-inf"))


@triton.jit
def rescaled_mass(ml, sl, m, AXIS: tl.constexpr = 0):
    """sum along AXIS of sl * exp(ml - m): masses sl, each relative to its maximum ml, summed relative to m (m
    broadcast against ml; -inf maxima add nothing; m = -inf counts as 0). The row or part mass that the statistics
    pass, the top-k merge's statistics and the speculative merges write."""
    return tl.sum(tl.where(ml > float("-inf"), sl * tl.exp2((ml - tl.where(m > float("-inf"), m, 0.0))
                                                            * 1.4426950408889634), 0.0), AXIS)


@triton.jit
def lane_keys(score, token):
    """Per lane one int64: ordered score bits high, (2**32-1-token) low, so that an integer max picks the highest
    score and, among equal scores, the lowest token id."""
    key = _ordered(score.to(tl.int32, bitcast=True)).to(tl.int64)
    return (key << 32) + (4294967295 - token.to(tl.int64))


@triton.jit
def pack_lanes(score, token):
    """The packed best (score, lowest id on ties) of a block's lanes: one block reduction."""
    return tl.max(lane_keys(score, token), 0)


@triton.jit
def segment_keys(x, lane, pos, start, seg, inv_t, greedy, key, HAS_TAU: tl.constexpr, LANES: tl.constexpr,
                 LW: tl.constexpr, FAST: tl.constexpr):
    """Each lane's packed key (`lane_keys`) of a block x [lanes, LW] of kept logits (`segment_block`: lane, pos from
    the segment's start): greedy rows the lane's first maximum, others the lane draw (module docstring)."""
    xm = tl.max(x, 1)                                       # per lane, in-thread
    if greedy:
        first = tl.min(tl.where(x == xm[:, None], pos, LANES * LW), 1)
        keys = lane_keys(xm, start + first)
    else:
        # weights exp(z - M_g) = 2^(x * c - M_g * log2 e), c = log2(e) / T (log2 e when x is z already)
        c = 1.4426950408889634
        m = xm
        if not HAS_TAU:
            c = inv_t * 1.4426950408889634
            m = xm * inv_t                                  # = the lane's max z exactly: rounding is monotone
        ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
        gid = seg * LANES + lane
        s, kk = lane_pick(exp2_w(x * c - ref[:, None], FAST), gid, key, LW)
        keys = lane_keys(lane_score(m, s, key, gid, FAST), start + tl.minimum(kk, LW - 1) * LANES + lane)
    return keys


@triton.jit
def segment_pack(x, lane, pos, start, seg, inv_t, greedy, key, HAS_TAU: tl.constexpr, LANES: tl.constexpr,
                 LW: tl.constexpr, FAST: tl.constexpr):
    """The packed best lane of a block (`segment_keys`): one block reduction."""
    return tl.max(segment_keys(x, lane, pos, start, seg, inv_t, greedy, key, HAS_TAU, LANES, LW, FAST), 0)


@triton.jit
def _is_cand_row(row, V, greedy_ptr, top_k_ptr, top_p_ptr, KMAX: tl.constexpr, P_LANES: tl.constexpr):
    """(candidate-path row?, k used for its candidates, top-p alone?): rows with 0 < top_k <= KMAX, and rows with
    top-p alone, which try the KMAX largest (their kept set is inside when those carry mass >= p)."""
    top_k = tl.load(top_k_ptr + row)
    sampled = tl.load(greedy_ptr + row) == 0
    by_k = (top_k > 0) & (top_k < V)
    p_only = sampled & (not by_k) & (tl.load(top_p_ptr + row) < 1.0) & P_LANES
    return (sampled & by_k & (top_k <= KMAX)) | p_only, tl.where(p_only, KMAX, top_k), p_only


@triton.jit
def _top_slice(z, live, m, lo, k, HB: tl.constexpr):
    """(sel, n): the live entries of block z in the top bins of an HB-bin histogram of [lo, m] (lo = the smallest
    live entry), down to the first bin where the count reaches k: an upper set (the bin number falls as z
    grows) with >= k entries, so it holds every entry >= the k-th largest. One histogram and one scan instead
    of a dozen halvings; n may exceed what the caller can take (ties, or most entries in one bin)."""
    scale = HB / tl.where(m > lo, m - lo, 1.0)                        # m == lo: every live entry in bin 0
    b = tl.where(live, tl.minimum(tl.floor((m - tl.where(live, z, m)) * scale), HB - 1.0), HB - 1.0).to(tl.int32)
    cum = tl.cumsum(tl.histogram(b, HB, mask=live), 0)
    bstar = tl.min(tl.where(cum >= k, tl.arange(0, HB), HB - 1), 0)
    sel = live & (b <= bstar)
    return sel, tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _kth_largest(z, k, lo_v, VSTEPS: tl.constexpr):
    """The k-th largest entry of block z (counted with multiplicity; -inf entries are padding), given that at
    least k entries are >= lo_v. First up to VSTEPS halvings of the value interval [lo_v, max] (the count falls
    from thousands to k within a few: real logits have gaps of ~1e-2 between neighbours up there, so some
    midpoint has exactly k entries above it, and then their minimum is the answer); if none did, a bisection
    on the ordered fp32 bits keeping count(z >= lo) >= k > count(z >= hi) (ties), with the same early stop."""
    hi_v = tl.max(z, 0)
    found = 0
    res = lo_v
    for _ in range(VSTEPS):                 # a loop, not unrolled: a rare branch, kept out of the code size
        if found == 0:
            mid = lo_v * 0.5 + hi_v * 0.5
            ge = z >= mid
            n = tl.sum(ge.to(tl.int32), 0)
            if n == k:
                res = tl.min(tl.where(ge, z, float("inf")), 0)
                found = 1
            elif n > k:
                lo_v = mid
            else:
                hi_v = mid
    if found == 0:
        lo = _ordered(lo_v.to(tl.int32, bitcast=True)).to(tl.int64)
        hi = _ordered(hi_v.to(tl.int32, bitcast=True)).to(tl.int64) + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            t = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
            ge = z >= t
            n = tl.sum(ge.to(tl.int32), 0)
            if n == k:
                lo = _ordered(tl.min(tl.where(ge, z, float("inf")), 0).to(tl.int32, bitcast=True)).to(tl.int64)
                hi = lo + 1
            elif n > k:
                lo = mid
            else:
                hi = mid
        res = _ordered(lo.to(tl.int32)).to(tl.float32, bitcast=True)
    return res


@triton.jit
def _keep_from_pairs(zi, cnt_gt, mass, m, top_k, top_p, p_only, lim_row, path):
    """(tau, path) from candidates zi (-inf padding) holding the whole top-k set K, with each one's count and
    mass sum exp(z - m) of strictly larger candidates: K = count < k; kept = in K and mass < p * mass(K), top-p
    relative to K's mass or, p_only (top-p alone, k = KMAX tried), to the row's mass lim_row: then path -3 when K
    carries less than p of it (the kept set may reach below K). tau = the smallest kept candidate."""
    in_k = (zi > float("-inf")) & (cnt_gt < top_k)
    lim_mass, path = _mass_of_p(tl.sum(tl.where(in_k, tl.exp(zi - m), 0.0), 0), top_p, p_only, lim_row, path)
    keep = in_k & (mass < _p_limit(top_p, lim_mass))
    return tl.min(tl.where(keep, zi, float("inf")), 0), path


@triton.jit
def _mass_of_p(sk, top_p, p_only, lim_row, path):
    """(the mass top-p is relative to, path): K's mass sk, or (p_only: top-p alone, k = KMAX tried) the row's mass
    lim_row, with path -3 when K carries less than p of it (the kept set may reach below K)."""
    lim_mass = sk
    if p_only:
        lim_mass = lim_row
        if sk < top_p * lim_mass * 1.0001:              # (margin for the sums' rounding)
            path = -3
    return lim_mass, path


@triton.jit
def _mmc_combine(a_max, a_min, a_n, b_max, b_min, b_n):
    return tl.maximum(a_max, b_max), tl.minimum(a_min, b_min), a_n + b_n


@triton.jit
def _max_min_count(x):
    """(max, smallest entry > -inf (+inf if none), count of entries > -inf) of a block in ONE reduction: one
    shared-memory round and barrier where three separate reductions take three."""
    live = x > float("-inf")
    return tl.reduce((x, tl.where(live, x, float("inf")), live.to(tl.int32)), 0, _mmc_combine)


@triton.jit
def _block_tau(z, n_live, m, top_k, top_p, p_only, lim_row, V, scratch_ptr, KP: tl.constexpr, JB: tl.constexpr,
               HB: tl.constexpr, HIST: tl.constexpr):
    """(tau, path) from a block z of candidates (-inf padding; n_live > 0 of them) that holds every token of its row
    above some bound with at least k tokens above it (so K, the top-k set, is inside): t_k = their k-th largest,
    then top-p on K: all pairs when the selected candidates are at most KP (each one's count and mass of strictly
    larger ones: K = count < k, kept = in K and mass < p * mass(K)), a bisection otherwise. Top-p alone (p_only:
    k = KMAX tried) is relative to the row's mass lim_row: path -3 when K carries less than p of it (the kept set
    may reach below K). path: n_live, or -3. scratch_ptr: KP floats of this row's scratch. HIST: the block is
    large enough for a histogram top slice (smaller blocks are replicated over the warps: halvings instead). m: the
    largest candidate (the row max)."""
    path = n_live
    live = z > float("-inf")
    t_k = m
    sel = live
    n_sel = n_live
    if n_live > KP:              # many candidates: keep a top slice holding >= k of them
        t_k = tl.min(tl.where(live, z, float("inf")), 0)
        if HIST:
            sel, n_sel = _top_slice(z, live, m, t_k, top_k, HB)
        if n_sel > KP:           # a slice too dense (ties): t_k by halving, then K alone
            t_k = _kth_largest(z, top_k, t_k, 12)
            sel = z >= t_k
            n_sel = tl.sum(sel.to(tl.int32), 0)
    if n_sel <= KP:
        # the usual case: the selected candidates compacted, then all pairs (no serial search)
        zi, cnt_gt, mass = _compact_pairs(z, sel, n_sel, m, scratch_ptr, KP, JB)
        tau, path = _keep_from_pairs(zi, cnt_gt, mass, m, top_k, top_p, p_only, lim_row, path)
        tl.debug_barrier()                              # every load of the scratch before a later reuse
    else:                            # |K| > KP (massive ties): top-p on K by a bisection
        e = tl.where(sel, tl.exp(z - m), 0.0)
        lim_mass, path = _mass_of_p(tl.sum(e, 0), top_p, p_only, lim_row, path)
        tau = t_k
        if (top_p < 1.0) & (path != -3):
            tau = _bisect(tl.where(sel, z, float("-inf")), e, t_k, m, V + 1, top_p, lim_mass, 0.0, scratch_ptr, 0, V,
                          1.0, scratch_ptr, 0, 0, False, 16, False)
    return tau, path


# ---------------------------------------------------------------------------------------------- lane path
@triton.jit
def _lane_max_kernel(logits_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, bitmask_ptr, mask_rows_ptr,
                     bitmask_stride, V, n_lanes, lmax_ptr, lmass_ptr, HAS_MASK: tl.constexpr, LANES: tl.constexpr,
                     LW: tl.constexpr, PL: tl.constexpr, VEC: tl.constexpr, KMAX: tl.constexpr, FAST: tl.constexpr,
                     P_LANES: tl.constexpr = True, PDL: tl.constexpr = False):
    """Program (row, PL lanes of a segment) of a candidate-path row: every lane's max z stored (-inf: nothing
    allowed), and for top-p-alone rows its mass sum exp(z - max) (the row's mass for the merge). No block
    reduction: a lane's LW tokens sit in one thread (the sampling pass's lanes, so the merge can draw). PDL:
    launched early (it waits first) and lets the merge launch early."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    prog = tl.program_id(1)
    is_c, top_k, p_only = _is_cand_row(row, V, greedy_ptr, top_k_ptr, top_p_ptr, KMAX, P_LANES)
    if is_c:
        seg = prog // (LANES // PL)
        sub = prog % (LANES // PL)
        z, pos = row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, seg * (LANES * LW), V,
                             bitmask_stride, HAS_MASK, LANES, LW, PL, sub, VEC, FAST)
        lm = tl.max(z, 1)                                            # in-thread
        g = row * n_lanes + seg * LANES + sub * PL + tl.arange(0, PL)
        tl.store(lmax_ptr + g, lm)
        if p_only:
            ref = tl.where(lm > float("-inf"), lm, 0.0)
            tl.store(lmass_ptr + g, tl.sum(tl.where(z > float("-inf"), tl.exp(z - ref[:, None]), 0.0), 1))


@triton.jit
def _group_bound(gm, top_k, HB: tl.constexpr):
    """(lo, ok): ok when at least k groups of lanes hold an allowed token (gm: the groups' maxima, -inf for an
    empty group); then lo is a value with at least k group maxima >= lo (each a distinct lane's max, so at least k
    tokens are >= lo: a valid bound for the top-k set), from ONE HB-bin histogram of the group maxima (the k-th
    largest group max lies in the histogram's bin b*; lo = the smallest group max in the bins down to b*). The
    merge works on NG / GS values instead of NG. Tight when the k largest tokens of a row rarely share groups:
    lo then lies near the k-th largest token and the lanes with max >= lo are ~k + a few; a group's lanes are
    strided (lane i, i + 512, ... at V = 129,280), so leaders in consecutive ids (LLM rows) fall in distinct
    groups (session 8's groups of consecutive lanes put them in a few: ~100 candidates against ~55)."""
    live_g = gm > float("-inf")
    hi, glo, n_g = _max_min_count(gm)
    scale = HB / tl.where(hi > glo, hi - glo, 1.0)
    b = tl.where(live_g, tl.minimum(tl.floor((hi - tl.where(live_g, gm, hi)) * scale), HB - 1.0), HB - 1.0)
    b = b.to(tl.int32)
    cum = tl.cumsum(tl.histogram(b, HB, mask=live_g), 0)
    bstar = tl.min(tl.where(cum >= top_k, tl.arange(0, HB), HB - 1), 0)
    lo = tl.min(tl.where(live_g & (b <= bstar), gm, float("inf")), 0)
    return lo, n_g >= top_k


@triton.jit
def _lane_bound(lm, live, n_live, top_k, LCAP: tl.constexpr, HB: tl.constexpr, ROUNDS: tl.constexpr):
    """(lo, n): the lanes with max >= lo (n of them, at least min(k, n_live)) are an upper set of the live lanes
    holding >= k lanes, cut down by up to ROUNDS histograms until at most LCAP lanes remain: each round bins the
    undecided lanes (max in [lo, hi]) into HB bins; the lanes above the bin where the count reaches k are in, those
    below out, and the bin itself (its own [lo, hi]) is split next round. Bins are monotone in the value, so every
    set here is a value interval: two scalars carry the state, no per-lane flags. Every token >= lo sits in a
    selected lane and at least k tokens do (each selected lane's max), so the top-k set is inside those lanes."""
    lo = tl.min(tl.where(live, lm, float("inf")), 0)
    hi = tl.max(lm, 0)
    need = top_k
    n = n_live
    for _ in range(ROUNDS):                 # a loop, not unrolled: a rare branch, kept out of the code size
        if (n > LCAP) & (hi > lo):
            undecided = (lm >= lo) & (lm <= hi)
            scale = HB / (hi - lo)
            b = tl.minimum(tl.floor((hi - tl.where(undecided, lm, hi)) * scale), HB - 1.0).to(tl.int32)
            hist = tl.histogram(b, HB, mask=undecided)
            cum = tl.cumsum(hist, 0)
            bins = tl.arange(0, HB)
            bstar = tl.min(tl.where(cum >= need, bins, HB - 1), 0)
            need -= tl.sum(tl.where(bins == bstar, cum - hist, 0), 0)         # the lanes above bin bstar are in
            in_b = undecided & (b == bstar)
            lo = tl.min(tl.where(in_b, lm, float("inf")), 0)
            hi = tl.max(tl.where(in_b, lm, float("-inf")), 0)
            n = tl.sum((lm >= lo).to(tl.int32), 0)
    return lo, n


@triton.jit
def _kept_column(logits_ptr, row, t, ok, V, inv_t, tau, bitmask_ptr, mrow, bitmask_stride, HAS_MASK: tl.constexpr):
    """z of the tokens t (one per lane) as the sampling pass sees them with tau: -inf where banned, padding (ok
    false or t >= V) or below tau."""
    z = load_z(logits_ptr, row, tl.where(ok, t, V), V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
    return tl.where(z >= tau, z, float("-inf"))


@triton.jit
def _block_candidates_tau(logits_ptr, row, gl, ok_l, V, inv_t, lo, m, top_k, top_p, p_only, lim_row, bitmask_ptr,
                          mrow, bitmask_stride, scratch_ptr, HAS_MASK: tl.constexpr, LCAP: tl.constexpr,
                          KP: tl.constexpr, JB: tl.constexpr, HB: tl.constexpr, LANES: tl.constexpr,
                          LW: tl.constexpr):
    """(tau, path) from the candidate lanes gl gathered as one [LCAP, LW] block: the tokens >= lo (every token >= lo
    is there, at least k of them, so the top-k set is inside), then `_block_tau` (a histogram top slice first
    when they are more than KP)."""
    k = tl.arange(0, LW)
    t = ((gl // LANES) * (LANES * LW) + gl % LANES)[:, None] + k[None, :] * LANES           # token ids
    zf = tl.reshape(_kept_column(logits_ptr, row, t, ok_l[:, None], V, inv_t, lo, bitmask_ptr, mrow, bitmask_stride,
                                 HAS_MASK), [LCAP * LW])
    n_c = tl.sum((zf > float("-inf")).to(tl.int32), 0)
    return _block_tau(zf, n_c, m, top_k, top_p, p_only, lim_row, V, scratch_ptr, KP, JB, HB, LCAP * LW >= 1024)


@triton.jit
def _draw_lanes(logits_ptr, row, gl, ok, lml, V, inv_t, tau, key, bitmask_ptr, mrow, bitmask_stride,
                HAS_MASK: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr):
    """The packed best of the lanes gl (ok: real lanes; lml: their maxima from the lane-maxima pass) by the
    sampling pass's rule with tau (`segment_pack`), one token column k at a time: two unrolled sweeps over the LW
    columns (loads from L1/L2) make every per-lane step elementwise, in the pass's own order (the running sum
    over k = 0 .. LW-1), so the draw is the pass's bit for bit and threads do not communicate until the final
    packed max. The max of a lane's kept tokens is its max when that is >= tau (kept), else there is none: no
    sweep for it (session 8 had a third). Returns (packed best, each lane's kept max M_g, its mass S_g)."""
    base = (gl // LANES) * (LANES * LW) + gl % LANES                 # the lane's first token
    m = tl.where(ok & (lml >= tau), lml, float("-inf"))
    ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
    s = tl.zeros_like(m)
    for k in tl.static_range(LW):
        s += exp2_w(_kept_column(logits_ptr, row, base + k * LANES, ok, V, inv_t, tau, bitmask_ptr, mrow,
                                 bitmask_stride, HAS_MASK) * 1.4426950408889634 - ref, FAST)
    target = _below(rng.uniform_tl(key, gl + 1073741824) * s, s)             # U_ID + g
    cdf = tl.zeros_like(m)
    kk = tl.zeros_like(gl)
    for k in tl.static_range(LW):
        cdf += exp2_w(_kept_column(logits_ptr, row, base + k * LANES, ok, V, inv_t, tau, bitmask_ptr, mrow,
                                   bitmask_stride, HAS_MASK) * 1.4426950408889634 - ref, FAST)
        kk += (cdf <= target).to(kk.dtype)
    return pack_lanes(lane_score(m, s, key, gl, FAST), base + tl.minimum(kk, LW - 1) * LANES), m, s


@triton.jit
def _lane_merge_kernel(logits_ptr, tau_ptr, path_ptr, tok_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, keys_ptr,
                       bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_lanes, lmax_ptr, lmass_ptr, lane_ptr,
                       scratch_ptr, HAS_MASK: tl.constexpr, NG: tl.constexpr, LCAP: tl.constexpr,
                       KMAX: tl.constexpr, KP: tl.constexpr, JB: tl.constexpr, HB: tl.constexpr,
                       ROUNDS: tl.constexpr, BLOCK: tl.constexpr, DRAW: tl.constexpr, LANES: tl.constexpr,
                       LW: tl.constexpr, FAST: tl.constexpr, UPTO: tl.constexpr = 4, P_LANES: tl.constexpr = True,
                       GROUPS: tl.constexpr = True, GS: tl.constexpr = 16, PDL: tl.constexpr = False,
                       mc_ptr=None, sc_ptr=None, pack_ptr=None, solved_ptr=None, n_prog=1, NP: tl.constexpr = 1,
                       STATS: tl.constexpr = False):
    """Program (row) of a candidate-path row: the lanes that may hold top-k tokens (GROUPS: `_group_bound` on
    the maxima of groups of GS lanes; `_lane_bound` on the stored lane maxima when that leaves more than LCAP
    lanes, or without GROUPS), their
    tokens gathered as a [LCAP, LW] block, tau from them (`_block_tau`), and with DRAW the row's token by the
    sampling rule on those lanes restricted to z >= tau (`segment_pack`, the pass's very operations per lane;
    every other lane holds no kept token, so it would score -inf in the pass). path[row]:
    gathered candidates (>= 1), -1 (more than LCAP lanes tie at the bound: exact row bisection, and the draw by a
    loop over the row here), -2 (nothing to filter or nothing allowed: tau = -inf), -3 (left to the histogram
    path: tau and the draw come later). tok[row]: the drawn token, -2 where the sampling pass must draw (with STATS,
    -1 on top-p-alone rows of the lane branch and on path -1 rows: not drawn, since the speculative step never
    reads their draw: its statistics pass draws them).
    UPTO < 4 (benchmarks, to time the stages by differences; the result is then wrong): 1 reads the lane maxima
    only, 2 adds the lane bound, 3 adds the candidates' gather and tau, 4 the draw (before session 9, stages 1-2
    also gathered the top / candidate lanes' tokens, so their numbers do not compare).
    STATS (with DRAW; the speculative step, kernels/speculative.py): a drawn row with top-k also gets the
    statistics pass's outputs for its part 0 (kept max, kept mass, the packed draw: mc, sc, pack of [R, n_prog(,
    NP)]) and solved[row] = 1, so that pass skips it (solved[row] = 0 on every other row)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    is_c, top_k, p_only = _is_cand_row(row, V, greedy_ptr, top_k_ptr, top_p_ptr, KMAX, P_LANES)
    top_p = tl.load(top_p_ptr + row)
    path = -2
    tau = float("-inf")
    tok = -2
    solved = 0
    if is_c:
        mrow = -1
        if HAS_MASK:
            mrow = tl.load(mask_rows_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        # the lane maxima as [NG / GS, GS]: group i holds the lanes i + j * NG / GS (strided: the leaders of a row
        # rarely share one), one group per thread (its lanes along dim 1, as the pass holds a lane's tokens), so
        # the group maxima, the counts and the lane list's placement are in-thread
        g = tl.arange(0, NG // GS)[:, None] + tl.arange(0, GS)[None, :] * (NG // GS)
        g = tl.max_contiguous(tl.multiple_of(g, [1, 1]), [1, 1])
        lm = tl.load(lmax_ptr + row * n_lanes + g, mask=g < n_lanes, other=float("-inf"))
        live = lm > float("-inf")
        gm = tl.max(lm, 1)
        m, _, n_any = _max_min_count(gm)                            # n_any: groups holding an allowed token
        tok = -1                                                    # nothing allowed
        if n_any > 0:
            lim_row = 0.0
            if p_only:
                lms = tl.load(lmass_ptr + row * n_lanes + g, mask=live, other=0.0)
                lim_row = tl.sum(tl.sum(tl.where(live, lms * tl.exp(lm - m), 0.0), 1), 0)
            lo = m
            n_sel = n_any * 0 + 1
            if UPTO >= 2:
                # lo: at least k tokens are >= lo (each of >= k lanes has its max there), or lo = -inf when the
                # row has fewer than k live lanes (then every token of every live lane is a candidate: with
                # lo = the smallest lane max, tokens below it that belong to the top-k set would be lost)
                ok = n_any < 0
                if GROUPS:
                    lo, ok = _group_bound(gm, top_k, HB)
                    if ok:
                        n_sel = tl.sum(tl.sum((lm >= lo).to(tl.int32), 1), 0)
                if (not ok) | (n_sel > LCAP):           # too few live groups, or too many lanes at the bound
                    n_live = tl.sum(tl.sum(live.to(tl.int32), 1), 0)
                    lo = float("-inf")
                    n_sel = n_live
                    if n_live >= top_k:
                        lo, n_sel = _lane_bound(tl.reshape(lm, [NG]), tl.reshape(live, [NG]), n_live, top_k, LCAP,
                                                HB, ROUNDS)
            key = tl.load(keys_ptr + row).to(tl.uint32)
            if n_sel <= LCAP:
                sel = ((lm >= lo) & live).to(tl.int32)
                per = tl.sum(sel, 1)                                # in-thread; one scan across the groups
                at = (tl.cumsum(per, 0) - per)[:, None] + tl.cumsum(sel, 1) - 1
                tl.store(lane_ptr + row * LCAP + at, g, mask=sel != 0)
                tl.debug_barrier()                                  # the lane list's stores before its loads
                i = tl.arange(0, LCAP)
                ok_l = i < n_sel
                gl = tl.load(lane_ptr + row * LCAP + i, mask=ok_l, other=0)
                lml = tl.load(lmax_ptr + row * n_lanes + gl, mask=ok_l, other=float("-inf"))
                if UPTO >= 3:
                    tau, path = _block_candidates_tau(logits_ptr, row, gl, ok_l, V, inv_t, lo, m, top_k, top_p,
                                                      p_only, lim_row, bitmask_ptr, mrow, bitmask_stride,
                                                      scratch_ptr + row * KP, HAS_MASK, LCAP, KP, JB, HB, LANES, LW)
                else:
                    tau = tl.max(lml, 0)
                draw = DRAW & (path != -3) & (UPTO >= 4)
                if STATS:
                    draw = draw & (p_only == 0)     # the speculative step never reads a top-p-alone row's draw
                if draw:
                    best, ml, sl = _draw_lanes(logits_ptr, row, gl, ok_l, lml, V, inv_t, tau, key, bitmask_ptr,
                                               mrow, bitmask_stride, HAS_MASK, LANES, LW, FAST)
                    tok = tl.where((best >> 32) > NEG_INF_KEY_C, 4294967295 - (best & 4294967295), -1).to(tl.int32)
                    if STATS:
                        # the speculative statistics of the row (its kept set lies in these lanes): max m (the
                        # largest token is always kept), mass sum exp(z - m) as the statistics pass sums it
                        solved = 1
                        o = row * n_prog
                        tl.store(mc_ptr + o, m)
                        tl.store(sc_ptr + o, rescaled_mass(ml, sl, m))
                        tl.store(pack_ptr + o * NP, best)
            else:
                path = -1
                real_k = tl.load(top_k_ptr + row)                  # top-p alone tried KMAX: the real k here
                real_k = tl.where((real_k > 0) & (real_k < V), real_k, V + 1)
                tau = _bisect_tau(logits_ptr, row, V, inv_t, real_k, top_p, bitmask_ptr, mrow, bitmask_stride,
                                  HAS_MASK, BLOCK)
                if DRAW and not STATS:      # rare (massive ties): the draw by a row loop (STATS: never read)
                    best = tl.full([], -9223372036854775807, tl.int64)
                    for c in range(0, tl.cdiv(V, LANES * LW)):
                        lane, pos, x = lane_block(logits_ptr, bitmask_ptr, row, c * (LANES * LW), V, mrow,
                                                  bitmask_stride, HAS_MASK, False, LANES, LW, LANES, 0, 1, FAST)
                        z = x * inv_t
                        best = tl.maximum(best, segment_pack(tl.where(z >= tau, z, float("-inf")), lane, pos,
                                                             c * (LANES * LW), c, inv_t, False, key, True, LANES,
                                                             LW, FAST))
                    tok = tl.where((best >> 32) > NEG_INF_KEY_C, 4294967295 - (best & 4294967295), -1).to(tl.int32)
        if path == -3:
            tok = -2
    elif (tl.load(greedy_ptr + row) == 0) & (((top_k > 0) & (top_k < V)) | (top_p < 1.0)):
        path = -3
    if path != -3:
        tl.store(tau_ptr + row, tau)
    tl.store(path_ptr + row, path)
    if DRAW:
        tl.store(tok_ptr + row, tok.to(tl.int64))
    if STATS:
        tl.store(solved_ptr + row, solved.to(tl.int8))


# ordered key of float("-inf") (fp32 bits 0xFF800000, negative: flip the 31 low bits)
NEG_INF_KEY = (0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF
NEG_INF_KEY_C = tl.constexpr(NEG_INF_KEY)
LCAP = 128            # lanes the lane path's merge gathers at most (x LW tokens each)
# Deleted after session 7's R3: a group bound over strided groups (lanes i, i + 256, ...: the group maxima crossed
# warps, and one sort of 256 values found the k-th largest) ran 50.7-52.1 us against 45.7-49.6 (top-k50 p0.9, B=64).
# GROUP_BOUND (session 8) grouped consecutive lanes (maxima in-warp) and took one histogram. Session 10: strided
# groups again, but each held by one thread (the merge loads its lane maxima as [512, 16], a group per thread, as
# the pass holds a lane's tokens), so the group maxima, the lane counts and the lane list's placement are in-thread
# and one scan over 512 places the list (the [8192] block before had a lane per thread, 16 apart: the group maxima
# took shuffles and the list a scan of 16 values per thread, 816 SASS instructions for its store alone); with the
# rare branches' loops no longer unrolled (`_lane_bound`'s rounds, `_kth_largest`'s halvings) the merge shrank from
# 10,950 to 6,752 SASS instructions (an ncu profile of the merge at B=64: 20% of its warps' stalls were instruction
# fetch; every SM runs the code once, cold). R1, top-k50 p0.9, B=64, twice each, us: flat 28.4 / 28.3 -> 21.1 /
# 21.6, peaked 30.3 / 30.3 -> 21.0 / 20.9; candidates per row (R2) peaked 99 -> 55 (its leaders now fall in distinct
# groups), flat 56 -> 55. Also measured then: the lane list holding the lanes' maxima (no dependent load of them)
# 21.5 / 21.5 flat, 20.8 / 20.8 peaked: no gain, deleted. R2 (us, B=64, flat; peaked, twice each; HEAD 27.3 / 27.2;
# 30.1 / 30.3): this merge (then with its parameters loaded before the PDL wait, below) 21.4 / 21.3; 20.6 / 20.6
# (36-38% of copy bandwidth), B=256 flat 62.7 / 63.0 against 74.0 / 73.9 (42% -> 50%; with the draw's sweeps as
# loops). Deleted after R2: the draw's two sweeps as loops with a run-time trip count (so not unrolled: a tenth of
# the code to fetch, but each column's load then waits for the previous one) 22.3 / 22.7; 21.5 / 21.5; the row's
# parameters loaded before the PDL wait (one dependent load less after it) 22.3 / 22.7 against 22.9 / 22.9; 21.5 /
# 21.5 against 21.6 / 21.6 (within noise); all-pairs blocks of 128 columns 24.5 / 24.4; 23.2 / 23.2.
GROUP_BOUND = True     # the merge bounds the top-k lanes by `_group_bound` first (the histogram rounds as fallback)
GROUP_SIZE = 16        # lanes per group of `_group_bound` (strided lanes, one group per thread of the merge)
LANE_ROUNDS = 3        # histogram rounds of `_lane_bound` (the merge's fallback when the group bound leaves > LCAP)
P_ONLY_LANES = True    # top-p-alone rows try the lane path (k = KMAX) before the histogram path
LANE_SHAPE = (128, 4)  # lane-maxima pass: (lanes per program, warps); R1: top-k50 sampling 34.8 / 86.4 us at
                      # B=64 / 256 vs 38.3 / 92.4 at 256x2, 35.8 / 91.1 at 256x8
# The merge's all-pairs comparison runs [KP, 32] blocks (JB). Session 9's R2, top-k50 p0.9 flat / peaked, us at
# B=64; B=256: JB 32 29.4 / 35.3; 74.5 / 75.2, 64 32.3 / 32.2; 75.7 / 78.8, 128 32.3 / 32.5; 82.2 / 80.3.
# more rows than SMs: the merge's launch options beside MERGE_WARPS (at 16 warps it builds with 94 registers, one
# program an SM, so 256 rows ran in two waves; capped at 64 registers, 72 B of spills, two fit an SM). Session 15
# R2, top-k50 p0.9 flat rows at B=256 (sample_from_logits' two launches, 4 input sets rotated, twice each): 56.5 /
# 56.5 us (55% of copy bandwidth) against 60.4 / 60.7 uncapped (52%); tokens = twin on every row.
MERGE_WAVE = dict(maxnreg=64)
MERGE_WARPS = 16      # warps of the lane path's merge (R1: 31.4 / 81.0 us at 16 vs 38.3 / 92.4 at 8; R2: 32 warps
                      # 34.2 / 85.9, 4 warps 67.2 / 102.8; R3: 8 warps at B=256, two programs per SM, 82.7 vs 77.8;
                      # session 10 R2, B=64 flat / peaked, with the draw's sweeps as loops: 8 warps 21.9 / 20.5
                      # against 16 warps' 22.5 / 21.5; not measured with the unrolled sweeps nor at B=256)
# Deleted after session 11's R4 (top-k50 p0.9, us, B=64 flat / peaked, B=256 flat / peaked, twice each, HEAD in the
# same run, compiled tests running beside it): the tau stage without its shared-memory layout conversions (12 -> 2
# in the merge's TTGIR: `_pairs_above` accumulating [128, 32] blocks and reducing once, its z loaded in the blocks'
# layout, the candidate block flattened with can_reorder) 25.8-26.3 / 25.2, 69.5 / 66.9-67.0 against HEAD's
# 21.1-21.6 / 20.3, 60.2 / 57.4-57.5; the same at 8 merge warps 21.6-22.0 / 20.9-21.2, 61.2-61.4 / 58.6-59.0. With
# HEAD's tau stage 8 warps were not re-measured (the unrolled sweeps): MERGE_WARPS stays 16.
# Deleted after session 9's R1 (top-k50 p0.9 flat / peaked, us at B=64; B=256): the candidates read column by
# column, one lane per thread (counted in-thread, placed by one scan, then all pairs): 34.4 / 38.0; 88.0 / 90.3 at
# 16 warps, 34.8 / 41.3 at 8, 51.0 / 58.4 at 4 (its tau stage 20.0 us at 4 warps: the extra 16-column sweep and
# the 8192 lane maxima held to the end spilled, 192 B of stack) against the [LCAP, 16] block's 29.9 / 31.8; 75.3 /
# 76.7 at 16 warps.


def lane_path(logits, params, bitmask, mrows, tau, path, tok, seg, lanes, kmax=KMAX, lcap=LCAP, shape=None, block=1024,
              stages=2, upto=4, p_lanes=None, stats=None):
    """The lane path's two launches for candidate-path rows (writes tau, path and, when tok is a tensor, the drawn
    tokens): `_lane_max_kernel` over (row, part of a segment), then `_lane_merge_kernel` per row. stats (with
    tok): the speculative statistics (mc, sc, pack, solved) of the rows the merge draws with top-k (its STATS)."""
    R, V = logits.shape
    dev = logits.device
    has_mask = bitmask is not None
    n_seg = triton.cdiv(V, seg)
    n_l = n_seg * lanes
    pl, warps = shape or LANE_SHAPE
    pl = min(pl, lanes)
    warps = max(1, min(warps, pl // 32))
    vec = max(1, pl // (32 * warps))
    lmax = torch.empty((R, n_l), dtype=torch.float32, device=dev)
    lmass = torch.empty_like(lmax)
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else path
    stride = bitmask.stride(0) if has_mask else 0
    ng = max(16, triton.next_power_of_2(n_l))
    _lane_max_kernel[(R, n_seg * (lanes // pl))](
        logits, params.inv_temperature, params.greedy, params.top_k, params.top_p, bm, mr, stride, V, n_l, lmax, lmass,
        HAS_MASK=has_mask, LANES=lanes, LW=seg // lanes, PL=pl, VEC=vec, KMAX=kmax, FAST=not INTERPRETING,
        P_LANES=P_ONLY_LANES if p_lanes is None else p_lanes, num_warps=warps, **pdl_kw())
    if stages < 2:
        return
    lane_buf = torch.empty((R, lcap), dtype=torch.int32, device=dev)
    scratch = torch.empty((R, KP), dtype=torch.float32, device=dev)
    draw = tok is not None
    out = {}
    if stats is not None:
        mc, sc, pack, solved = stats
        out = dict(mc_ptr=mc, sc_ptr=sc, pack_ptr=pack, solved_ptr=solved, n_prog=pack.shape[1], NP=pack.shape[2],
                   STATS=True)
    _lane_merge_kernel[(R,)](
        logits, tau, path, tok if draw else path, params.inv_temperature, params.greedy, params.top_k, params.top_p,
        params.keys, bm, mr, stride, V, n_l, lmax, lmass, lane_buf, scratch, HAS_MASK=has_mask,
        NG=ng, LCAP=lcap, KMAX=kmax, KP=KP, JB=32, HB=HB, ROUNDS=LANE_ROUNDS,
        BLOCK=min(block, triton.next_power_of_2(V)), DRAW=draw, LANES=lanes, LW=seg // lanes,
        FAST=not INTERPRETING, UPTO=upto, P_LANES=P_ONLY_LANES if p_lanes is None else p_lanes,
        GROUPS=GROUP_BOUND, GS=min(GROUP_SIZE, ng), num_warps=MERGE_WARPS,
        **({} if one_wave(R, dev) else MERGE_WAVE), **out, **pdl_kw())


def needs_histogram_path(params, V: int, kmax: int = KMAX) -> bool | None:
    """Does some row filter in a way the candidate path does not take (top-p alone, top_k > kmax)? None when the
    parameters live on a GPU (unknown without a sync: the histogram kernels then run and skip solved rows)."""
    if params.top_k.is_cuda:
        return None
    k, p = params.top_k, params.top_p
    filt = (((k > 0) & (k < V)) | (p < 1)) & ~params.greedy
    cand = (k > 0) & (k <= kmax) & (k < V)
    return bool((filt & ~cand).any())


def needs_lane_path(params, V: int, kmax: int = KMAX, p_lanes: bool | None = None) -> bool | None:
    """Does some row take the lane path (0 < top_k <= kmax; top-p alone when p_lanes, default P_ONLY_LANES)?
    None when the parameters live on a GPU (the lane kernels then run and skip other rows)."""
    if params.top_k.is_cuda:
        return None
    k, p = params.top_k, params.top_p
    sampled = ~params.greedy.bool()
    by_k = (k > 0) & (k < V)
    p_only = sampled & ~by_k & (p < 1) & (P_ONLY_LANES if p_lanes is None else p_lanes)
    return bool(((sampled & by_k & (k <= kmax)) | p_only).any())


def thresholds_and_paths(logits, params, bitmask, mrows, block=1024, cmax=CMAX, chunk=CHUNK, stages=6,
                         tau_warps=None, histogram=None, kmax=KMAX, draw=None, lcap=LCAP, lane_shape=None,
                         p_lanes=None, lane_rows=None, stats=None):
    """(tau [R] fp32, path int32 [R]) for every row (params: sampling.RowParams; mrows: int64 [R] when bitmask
    is given). path: >= 1 the candidates a row's tau came from, -1 an exact bisection fallback, -2 no filtering.
    Rows with 0 < top_k <= kmax (and top-p alone, trying k = kmax): the lane path, two launches (`lane_path`:
    the lane maxima, one read of the row; the per-row merge). Other filtered rows: the histogram path, four
    launches (skipped when the host knows no row needs it: histogram=False; None asks needs_histogram_path). No
    host synchronisation.
    draw=(seg, lanes): the lane path works on the sampling rule's lanes of that layout and also draws the row's
    token (kernels/sampling.py's rule); the result gains a third entry, tok int64 [R] (-2 where the sampling pass
    must draw: rows off the lane path, and top-p-alone rows left to the histogram path).
    cmax, chunk (the lane layout's segment when draw is None), kmax, lcap (powers of two) are parameters so that
    tests can force fallbacks and several segments on a small vocabulary; stages < 6 stops after that many
    launches (benchmarks time each stage by differences; the result is then unfinished). lane_shape: the
    lane-maxima pass's (lanes per program, warps), default LANE_SHAPE. p_lanes: top-p-alone rows try the lane
    path (default P_ONLY_LANES). lane_rows=False (the host knows no row takes the lane path: needs_lane_path): its
    two launches are skipped (every row starts as the histogram path's). stats (with draw): `lane_path`'s."""
    R, V = logits.shape
    dev = logits.device
    tau = empty((R,), torch.float32, dev)
    path = empty((R,), torch.int32, dev)
    tok = empty((R,), torch.int64, dev) if draw else None
    done = (lambda: (tau, path, tok)) if draw else (lambda: (tau, path))
    if R == 0:
        return done()
    has_mask = bitmask is not None
    chunk = min(chunk, max(16, triton.next_power_of_2(V)))
    cmax = min(cmax, max(16, triton.next_power_of_2(V)))          # there are never more candidates than tokens
    n_chunks = triton.cdiv(V, chunk)
    greedy = params.greedy                  # bool or int8: the kernels test it against 0
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else path
    stride = bitmask.stride(0) if has_mask else 0
    seg, lanes = draw or (chunk, min(256, chunk))
    if lane_rows is False:
        path.fill_(-3)                      # every row left to the histogram path (which skips unfiltered rows)
        if draw:
            tok.fill_(-2)                   # the sampling pass draws every row
        if stats is not None:
            stats[3].zero_()                # no row solved
    else:
        lane_path(logits, params, bitmask, mrows, tau, path, tok, seg, min(lanes, seg), kmax, lcap, lane_shape,
                  block, stages, p_lanes=p_lanes, stats=stats)
    if stages < 2:
        return done()
    if histogram is None:
        histogram = needs_histogram_path(params, V, kmax)
    if histogram is False or stages < 3:
        return done()
    consts = dict(INV_W=INV_W, BIN_LIMIT=BIN_LIMIT)
    cmax_c = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    csum_c = torch.empty_like(cmax_c)
    cbin_c = torch.empty((R, n_chunks, 2), dtype=torch.int32, device=dev)     # chunk top bin, allowed tokens
    hist = torch.empty((R, n_chunks, NB), dtype=torch.int32, device=dev)
    m = torch.empty((R,), dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    low = torch.empty((R, 2), dtype=torch.int32, device=dev)       # candidate bins [low, high]
    ncand = torch.empty((R,), dtype=torch.int32, device=dev)
    outside = torch.empty((R, n_chunks, 2), dtype=torch.float64, device=dev)
    offsets = torch.empty((R, n_chunks), dtype=torch.int32, device=dev)
    cand_h = torch.empty((R, cmax), dtype=torch.float32, device=dev)
    _hist_kernel[(R, n_chunks)](logits, params.inv_temperature, greedy, params.top_k, params.top_p, path, bm, mr,
                                stride, V, n_chunks, cmax_c, csum_c, cbin_c, hist, HAS_MASK=has_mask, CHUNK=chunk,
                                NB=NB, num_warps=HIST_WARPS, **consts)
    if stages < 4:
        return done()
    _select_kernel[(R,)](greedy, params.top_k, params.top_p, path, V, n_chunks, cmax_c, csum_c, cbin_c, hist, m, s,
                         low, ncand, offsets, NCP=max(2, triton.next_power_of_2(n_chunks)), NB=NB, CMAX=cmax,
                         num_warps=SELECT_WARPS, **consts)
    if stages < 5:
        return done()
    glanes = min(GATHER_SHAPE[0], chunk)
    gwarps = max(1, min(GATHER_SHAPE[1], glanes // 32))
    _gather_kernel[(R, n_chunks)](logits, params.inv_temperature, bm, mr, stride, V, n_chunks, low, ncand, offsets,
                                  cand_h, m, outside, HAS_MASK=has_mask, LANES=glanes, LW=chunk // glanes, CMAX=cmax,
                                  VEC=max(1, glanes // (32 * gwarps)), FAST=not INTERPRETING, num_warps=gwarps,
                                  **consts)
    if stages < 6:
        return done()
    scratch = torch.empty((R, KP), dtype=torch.float32, device=dev)
    _tau_kernel[(R,)](logits, tau, params.inv_temperature, greedy, params.top_k, params.top_p, path, bm, mr, stride,
                      V, n_chunks, m, s, ncand, cand_h, outside, scratch, HAS_MASK=has_mask,
                      BLOCK=min(block, triton.next_power_of_2(V)), CMAX=cmax, SMALL=min(SMALL, cmax),
                      NCP=max(2, triton.next_power_of_2(n_chunks)), KP=KP, HB=HB_CUT,
                      num_warps=tau_warps or TAU_WARPS)
    path = torch.where(path == -3, ncand, path)
    return done()
