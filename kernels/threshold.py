"""The exact top-k/top-p threshold tau of every row, in a few parallel passes instead of a 32-step bisection.

Two paths, both exact:
- candidate path (rows with 0 < top_k <= KMAX, and rows with top-p alone, which try k = KMAX and keep the
  result when those KMAX tokens carry >= p of the row's mass, i.e. the kept set is inside them; two launches, one
  read of the row): `_cand_kernel` per (row,
  4096-token segment) finds t_c, a value with >= k of its 256 lane maxima above it (so the row's k-th largest z is
  >= t_c), and writes its tokens >= t_c compactly; `_cand_tau_kernel` per row keeps the candidates >= max_c t_c
  (exactly the row's tokens above that bound, a superset of the top-k set), finds the k-th largest among them and
  applies top-p on the top-k set (all pairs when it is small). A segment with more than CAND candidates (massive
  ties) sends its row to the exact row-wide bisection inside the merge.
- histogram path (top_k > KMAX; top-p alone when the KMAX largest carry less than p), below.

Definition (kernels/sampling.py): the top-k set K = {v : fewer than k allowed tokens have z > z_v}; v in K is
kept iff the softmax mass of the tokens with z > z_v is < p times the mass of K (top-p on the renormalised top-k
set); the kept set is {z >= tau}. Rows without filters (and greedy rows, and rows with nothing allowed) get
tau = -inf. K is {z >= t_k}, t_k the k-th largest z, so its mass needs t_k first: the searches below find t_k
(count only), then tau.

Method: bucket z on a fixed grid of width 1/INV_W (bin a = floor(z * INV_W), exact: INV_W is a power of two).
A token in a lower bin than another has a strictly smaller z, so once the tokens in the top bins are at least k
(rows with top-k), or certainly carry mass >= p (rows with top-p alone; each token of bin a has exp(z - m) >=
exp(a / INV_W - m)), every token below those bins is dropped. Only the tokens of the top bins (the candidates; a few dozen for top_k ~ 50 on real logits) are
compacted, and tau is found on them exactly. Four launches, all over (row, vocab chunk) programs:
  1. `_hist_kernel`    (row, chunk): chunk max, chunk sum of exp, histogram of bins below the chunk's top bin;
  2. `_select_kernel`  (row): merge the chunk histograms, pick the candidate bins, each chunk's output offset;
  3. `_gather_kernel`  (row, chunk): write the chunk's candidates (z values) compactly (lane-major order: one
                             scan over lane counts, a running count inside each lane, held by one thread);
  4. `_tau_kernel`     (row): bisection on the candidates held in registers (exact: keep(t) only changes at
                             candidate values, and every other token is below them).
Passes 1 and 3 read the logits (the second read mostly hits L2 at decode batch sizes); 2 and 4 touch only small
buffers. A row whose candidates exceed CMAX (a flat distribution with top-p alone, or huge |logits|) falls back
to the bisection on the fp32 bit pattern (`_bisect_tau`, <= 33 serial passes over that row): exact, slow, rare.
"""
import torch
import triton
import triton.language as tl

from . import rng
from .backend import INTERPRETING, empty

INV_W = 32.0          # bins per unit of z: a token's mass is known to within a factor e^(1/32) from its bin
NB = 512              # bins per chunk histogram (the last one collects everything lower): 16 units of z
CHUNK = 4096          # tokens per (row, chunk) program in passes 1 and 3
CMAX = 4096           # most candidates a row may have on the fast path
SMALL = 256           # candidates up to this many take the short-block variant of the last pass
GATHER_LANES = 512    # lanes of the candidate pass's [lanes, CHUNK / lanes] blocks
BIN_LIMIT = 1 << 24   # |z * INV_W| is clamped here (bin numbers and bin edges stay exact in fp32)
KMAX = 64             # rows with 0 < top_k <= KMAX take the candidate path (two launches, one read)
CAND = 128            # candidates a (row, segment) program may keep on that path; more: the row's exact fallback
KP = 128              # top-k sets up to this size get top-p by all pairs (larger: a bisection)
KD = 64               # top-k sets up to this size get their token drawn in the merge (larger: the sampling pass)
SEG_STEPS = 8         # bisection steps on a segment's lane maxima


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
    """Program (row, chunk): chunk max, sum exp(z - chunk max), and counts per bin below the chunk's top bin
    (bin i = top bin - i; bin NB-1 collects the rest). Rows without filters write nothing (nobody reads it)."""
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
        tl.store(cbin_ptr + o, top)
        tl.store(hist_ptr + o * NB + tl.arange(0, NB), hist)


@triton.jit
def _select_kernel(greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr, V, n_chunks, cmax_ptr, csum_ptr, cbin_ptr, hist_ptr,
                   m_ptr, s_ptr, low_ptr, ncand_ptr, offset_ptr,
                   NCP: tl.constexpr, NB: tl.constexpr, INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr,
                   CMAX: tl.constexpr):
    """Program (row): row max m and sum s; the lowest candidate bin; candidates per chunk -> output offsets.
    ncand: -2 = no filtering (tau = -inf), -1 = fall back to the bisection, >= 1 = candidates on the fast path."""
    row = tl.program_id(0).to(tl.int64)
    filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr)
    ncand = -2
    if filt:
        c = tl.arange(0, NCP)
        okc = c < n_chunks
        cm = tl.load(cmax_ptr + row * n_chunks + c, mask=okc, other=float("-inf"))
        cs = tl.load(csum_ptr + row * n_chunks + c, mask=okc, other=0.0)
        live = cm > float("-inf")
        top = tl.load(cbin_ptr + row * n_chunks + c, mask=okc & live, other=-BIN_LIMIT - 1)   # no overflow below
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
            # lower bound of each bin's mass: its tokens have z >= bin / INV_W (bins and edges exact in fp32)
            low_mass = counts.to(tl.float32) * tl.exp((mbin - b).to(tl.float32) * (1.0 / INV_W) - m)
            cum_count = tl.cumsum(counts, 0)
            cum_mass = tl.cumsum(low_mass, 0) * 0.9999                      # margin for exp/sum rounding
            # with top-k the candidates must hold all of K (its mass renormalises top-p): stop on the count only
            done = ((cum_count >= top_k) | ((top_k >= V) & (cum_mass >= top_p * s))) & (b < NB - 1)
            j0 = tl.min(tl.where(done, b, NB), 0)
            ncand = tl.sum(tl.where(b <= j0, counts, 0), 0)
            fast = (j0 < NB) & (ncand <= CMAX) & (mbin < BIN_LIMIT - 1) & (mbin - NB > -BIN_LIMIT)
            if fast:
                per_chunk = tl.sum(tl.where(b[None, :] <= j0, h, 0), 1)    # [NCP]
                tl.store(offset_ptr + row * n_chunks + c, tl.cumsum(per_chunk, 0) - per_chunk, mask=okc)
                tl.store(low_ptr + row, mbin - j0)
            else:
                ncand = -1
            tl.store(m_ptr + row, m)
            tl.store(s_ptr + row, s)
        else:
            ncand = -2                                                      # nothing allowed: tau = -inf
    tl.store(ncand_ptr + row, ncand)


@triton.jit
def lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK: tl.constexpr,
                 FULL: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr):
    """z = x / T of the tokens start + k * LANES + l as a [LANES, LW] block (lanes along dim 0, contiguous in
    memory and spread over threads; a lane's LW tokens along dim 1, held by one thread, so per-lane reductions
    need no communication), -inf for padding and banned tokens. FULL: no token is past V (no bounds checks).
    Returns (z, position in the block)."""
    lane = tl.arange(0, LANES)
    k = tl.arange(0, LW)
    pos = lane[:, None] + k[None, :] * LANES
    ptrs = logits_ptr + row * V + start + pos
    if FULL:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=start + pos < V, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        # the word offsets keep dim 0 first in contiguity, so the words load takes the logits' layout
        wptr = bitmask_ptr + mrow * bitmask_stride + (start + k[None, :] * LANES) // 32 + lane[:, None] // 32
        if FULL:
            words = tl.load(wptr, mask=mrow >= 0, other=-1)
        else:
            words = tl.load(wptr, mask=(mrow >= 0) & (start + pos < V), other=-1)
        x = tl.where((words & (1 << (lane % 32))[:, None]) != 0, x, float("-inf"))
    return x * inv_t, pos


@triton.jit
def row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, start, V, bitmask_stride,
                HAS_MASK: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr):
    """`lane_block_z` of row `row` from `start`, with the row's mask row and 1/T loaded here; the bounds-checked
    form only for the block that reaches past V."""
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    inv_t = tl.load(inv_t_ptr + row)
    if start + LANES * LW <= V:
        z, pos = lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK,
                              True, LANES, LW)
    else:
        z, pos = lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK,
                              False, LANES, LW)
    return z, pos


@triton.jit
def _gather_kernel(logits_ptr, inv_t_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_chunks, low_ptr,
                   ncand_ptr, offset_ptr, cand_ptr, HAS_MASK: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                   INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr, CMAX: tl.constexpr):
    """Program (row, chunk): the chunk's candidates (z in a bin >= the lowest candidate bin), written compactly
    at the chunk's offset in lane-major order (one scan over the lanes' counts, then a running count inside each
    lane, held by one thread)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(ncand_ptr + row) > 0:
        z, pos = row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, chunk * (LANES * LW), V,
                             bitmask_stride, HAS_MASK, LANES, LW)
        is_c = ((z > float("-inf")) & (_bin(z, INV_W, BIN_LIMIT) >= tl.load(low_ptr + row))).to(tl.int32)
        per_lane = tl.sum(is_c, 1)
        lane_start = tl.cumsum(per_lane, 0) - per_lane
        at = tl.load(offset_ptr + row * n_chunks + chunk) + lane_start[:, None] + tl.cumsum(is_c, 1) - 1
        tl.store(cand_ptr + row * CMAX + at, z, mask=is_c != 0)


@triton.jit
def _ordered(x):
    """int32 bits of an fp32 -> int32 key with the same order (an involution: apply again to go back)."""
    return tl.where(x >= 0, x, x ^ 0x7FFFFFFF)


@triton.jit
def _count_mass_above(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, t, m, s,
                      HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    cnt = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        above = z > t
        cnt += above.to(tl.int32)
        mass += tl.where(above, tl.exp(z - m), 0.0)
    return tl.sum(cnt, 0), tl.sum(mass, 0) / s


@triton.jit
def _p_limit(top_p, s):
    """The mass that strictly larger tokens must stay below: p * s, unbounded when p >= 1 (top-p off, even where
    float masses saturate on huge logit gaps)."""
    lim = top_p * s
    if top_p >= 1.0:
        lim = float("inf")
    return lim


@triton.jit
def _mass_at_least(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, t, m, HAS_MASK: tl.constexpr,
                   BLOCK: tl.constexpr):
    """sum of exp(z - m) over the row's tokens with z >= t."""
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        mass += tl.where(z >= t, tl.exp(z - m), 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _bisect_tau(logits_ptr, row, V, inv_t, top_k, top_p, bitmask_ptr, mrow, bitmask_stride,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """The fallback: statistics pass, then bisections on the ordered fp32 bits (<= 32 passes each): t_k (count
    only) when top-k filters, the mass of K, then tau."""
    m = float("-inf")
    s = 0.0
    zmin = float("inf")
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        new_m = tl.maximum(m, tl.max(z, 0))
        if new_m > float("-inf"):
            s = s * tl.exp(m - new_m) + tl.sum(tl.where(z > float("-inf"), tl.exp(z - new_m), 0.0), 0)
            m = new_m
        zmin = tl.minimum(zmin, tl.min(tl.where(z > float("-inf"), z, float("inf")), 0))
    tau = float("-inf")
    if m > float("-inf"):
        sk = s
        if top_k < V:                                   # K = {z >= t_k}: its mass renormalises top-p
            t_k = _bisect_row(logits_ptr, row, V, inv_t, top_k, 2.0, bitmask_ptr, mrow, bitmask_stride, zmin, m,
                              s, HAS_MASK, BLOCK)
            sk = _mass_at_least(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, t_k, m, HAS_MASK,
                                BLOCK)
        tau = _bisect_row(logits_ptr, row, V, inv_t, top_k, top_p, bitmask_ptr, mrow, bitmask_stride, zmin, m, sk,
                          HAS_MASK, BLOCK)
    return tau


@triton.jit
def _bisect_row(logits_ptr, row, V, inv_t, top_k, top_p, bitmask_ptr, mrow, bitmask_stride, zmin, m, s,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Smallest t among the row's values with keep(t): count(z > t) < k and mass(z > t) < p * s (s: the mass p
    is relative to); keep is monotone in t and true at t = max."""
    cnt, mass = _count_mass_above(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, zmin, m, s,
                                  HAS_MASK, BLOCK)
    tau = zmin
    if (cnt >= top_k) | (mass >= _p_limit(top_p, 1.0)):
        lo = _ordered(zmin.to(tl.int32, bitcast=True)).to(tl.int64)      # keep(lo) is false
        hi = _ordered(m.to(tl.int32, bitcast=True)).to(tl.int64)         # keep(hi) is true
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            t = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
            cnt, mass = _count_mass_above(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, t,
                                          m, s, HAS_MASK, BLOCK)
            if (cnt < top_k) & (mass < _p_limit(top_p, 1.0)):
                hi = mid
            else:
                lo = mid
        tau = _ordered(hi.to(tl.int32)).to(tl.float32, bitcast=True)
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
        t_k = _bisect_block(z, e, zmin, m, top_k, 2.0, 1.0)
        sk = tl.sum(tl.where(z >= t_k, e, 0.0), 0)
    return _bisect_block(z, e, zmin, m, top_k, top_p, sk)


@triton.jit
def _bisect_block(z, e, zmin, m, top_k, top_p, s):
    """Smallest t among the values of block z (weights e) with count(z > t) < k and mass(z > t) < p * s:
    bisection on the ordered fp32 bits between the smallest value and m (<= 32 steps, each a compare and two
    block reductions)."""
    above = z > zmin
    tau = zmin
    if (tl.sum(above.to(tl.int32), 0) >= top_k) | (tl.sum(tl.where(above, e, 0.0), 0) >= _p_limit(top_p, s)):
        lo = _ordered(zmin.to(tl.int32, bitcast=True)).to(tl.int64)          # keep(lo) is false
        hi = _ordered(m.to(tl.int32, bitcast=True)).to(tl.int64)             # keep(hi) is true
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            t = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
            above = z > t
            if (tl.sum(above.to(tl.int32), 0) < top_k) & (tl.sum(tl.where(above, e, 0.0), 0) < _p_limit(top_p, s)):
                hi = mid
            else:
                lo = mid
        tau = _ordered(hi.to(tl.int32)).to(tl.float32, bitcast=True)
    return tau


@triton.jit
def _direct_candidates(cand_ptr, n, m, s, top_k, top_p, V, BLOCK: tl.constexpr, JB: tl.constexpr):
    """tau from n <= BLOCK candidates by the definition, without a serial search: for every candidate v the count
    and the mass of candidates with z > z_v (blocks of JB columns of the all-pairs comparison, independent of
    each other); K = the candidates with count < k (all of K is among them when top-k filters; otherwise s is
    the row's whole mass); kept iff in K and mass < p * mass(K); tau = the smallest kept candidate (the largest
    one is always kept). Exact on the candidates for the same reason as _bisect_candidates."""
    i = tl.arange(0, BLOCK)
    z = tl.load(cand_ptr + i, mask=i < n, other=float("-inf"))
    cnt = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for j0 in tl.static_range(0, BLOCK, JB):
        j = j0 + tl.arange(0, JB)
        zj = tl.load(cand_ptr + j, mask=j < n, other=float("-inf"))
        ej = tl.where(zj > float("-inf"), tl.exp(zj - m), 0.0)
        gt = zj[None, :] > z[:, None]
        cnt += tl.sum(gt.to(tl.int32), 1)
        mass += tl.sum(tl.where(gt, ej[None, :], 0.0), 1)
    live = z > float("-inf")
    in_k = (cnt < top_k) & live
    sk = s
    if top_k < V:
        sk = tl.sum(tl.where(in_k, tl.exp(z - m), 0.0), 0)
    keep = in_k & (mass < _p_limit(top_p, sk))
    return tl.min(tl.where(keep, z, float("inf")), 0)


@triton.jit
def _tau_kernel(logits_ptr, tau_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr, bitmask_ptr,
                mask_rows_ptr, bitmask_stride, V, m_ptr, s_ptr, ncand_ptr, cand_ptr,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, CMAX: tl.constexpr, SMALL: tl.constexpr):
    """Program (row) of the histogram path: tau from the candidates (fast path) or from the bisection (fallback).
    Rows the candidate path solved keep its tau."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(todo_ptr + row) == -3:
        _tau_row(logits_ptr, tau_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr, bitmask_ptr,
                 mask_rows_ptr, bitmask_stride, V, m_ptr, s_ptr, ncand_ptr, cand_ptr, row, HAS_MASK, BLOCK, CMAX,
                 SMALL)


@triton.jit
def _tau_row(logits_ptr, tau_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr, bitmask_ptr,
             mask_rows_ptr, bitmask_stride, V, m_ptr, s_ptr, ncand_ptr, cand_ptr, row, HAS_MASK: tl.constexpr,
             BLOCK: tl.constexpr, CMAX: tl.constexpr, SMALL: tl.constexpr):
    filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr, todo_ptr)
    ncand = tl.load(ncand_ptr + row)
    tau = float("-inf")
    if ncand > 0:
        if ncand <= SMALL:                          # the usual case (top_k ~ 50): all pairs, no serial search
            tau = _direct_candidates(cand_ptr + row * CMAX, ncand, tl.load(m_ptr + row), tl.load(s_ptr + row),
                                     top_k, top_p, V, SMALL, 32)
        else:
            tau = _bisect_candidates(cand_ptr + row * CMAX, ncand, tl.load(m_ptr + row), tl.load(s_ptr + row),
                                     top_k, top_p, V, CMAX)
    elif ncand == -1:
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
def _is_cand_row(row, V, greedy_ptr, top_k_ptr, top_p_ptr, KMAX: tl.constexpr):
    """(candidate-path row?, k used for its candidates, top-p alone?): rows with 0 < top_k <= KMAX, and rows with
    top-p alone, which try the KMAX largest (their kept set is inside when those carry mass >= p)."""
    top_k = tl.load(top_k_ptr + row)
    sampled = tl.load(greedy_ptr + row) == 0
    by_k = (top_k > 0) & (top_k < V)
    p_only = sampled & (not by_k) & (tl.load(top_p_ptr + row) < 1.0)
    return (sampled & by_k & (top_k <= KMAX)) | p_only, tl.where(p_only, KMAX, top_k), p_only


@triton.jit
def scatter32(ptr, val, ok, FAST: tl.constexpr):
    """Store val (32-bit) at ptr where ok, element by element in the layout the values already have. FAST (GPUs):
    inline PTX, so that Triton does not first convert the whole block to the layout it picks for a data-dependent
    store (a shared-memory round trip of every element: ~50 barriers for a [256, 16] block); the interpreter:
    tl.store."""
    if FAST:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
                                  "=r,l,r,r", [ptr.to(tl.int64, bitcast=True), val.to(tl.int32, bitcast=True),
                                               ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=ok)


@triton.jit
def _cand_kernel(logits_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride,
                 V, n_seg, cval_ptr, cid_ptr, cnt_ptr, tc_ptr, sm_ptr, ss_ptr, HAS_MASK: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                 CAND: tl.constexpr, KMAX: tl.constexpr, STEPS: tl.constexpr, IDS: tl.constexpr, FAST: tl.constexpr):
    """Program (row, segment) of a row with 0 < top_k <= KMAX: the segment as [LANES, LW] (lane l: tokens start +
    j * LANES + l, held by one thread), its lane maxima, and t_c = a value with at least k lane maxima >= it (a
    bisection on the lane maxima; -inf when fewer than k lanes hold an allowed token). At least k tokens of the
    row are >= t_c, so the row's k-th largest z is >= t_c: every token of the top-k set is >= t_c. The segment's
    tokens >= t_c (a few more than k) are written compactly (lane-major; at most CAND, their count n_c may say
    more: the row then takes the exact fallback)."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    is_c, top_k, p_only = _is_cand_row(row, V, greedy_ptr, top_k_ptr, top_p_ptr, KMAX)
    if is_c:
        start = seg * (LANES * LW)
        z, pos = row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, start, V, bitmask_stride,
                             HAS_MASK, LANES, LW)
        lm = tl.max(z, 1)                                            # lane maxima, in-thread
        live = lm > float("-inf")
        if p_only:                       # top-p alone needs the row's whole mass: the segment's max and sum
            mseg = tl.max(lm, 0)
            ref = tl.where(mseg > float("-inf"), mseg, 0.0)
            tl.store(sm_ptr + row * n_seg + seg, mseg)
            tl.store(ss_ptr + row * n_seg + seg, tl.sum(tl.sum(tl.where(z > float("-inf"), tl.exp(z - ref), 0.0),
                                                               1), 0))
        t = float("-inf")
        if tl.sum(live.to(tl.int32), 0) >= top_k:
            lo = tl.min(tl.where(live, lm, float("inf")), 0)         # invariant: >= k lane maxima are >= lo
            hi = tl.max(lm, 0)
            for _ in tl.static_range(STEPS):
                mid = lo * 0.5 + hi * 0.5                            # no overflow for any finite lo, hi
                ok = tl.sum((lm >= mid).to(tl.int32), 0) >= top_k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            t = lo
        keep = ((z >= t) & (z > float("-inf"))).to(tl.int32)
        per_lane = tl.sum(keep, 1)
        lane_start = tl.cumsum(per_lane, 0) - per_lane
        at = lane_start[:, None] + tl.cumsum(keep, 1) - 1
        o = row * n_seg + seg
        ok = (keep != 0) & (at < CAND)
        scatter32(cval_ptr + o * CAND + at, z, ok, FAST)
        if IDS:
            scatter32(cid_ptr + o * CAND + at, (start + pos).to(tl.int32), ok, FAST)
        tl.store(cnt_ptr + o, tl.sum(per_lane, 0))
        tl.store(tc_ptr + o, t)


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
    for _ in tl.static_range(VSTEPS):
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
def _cand_tau_kernel(logits_ptr, tau_ptr, path_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, keys_ptr,
                     bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_seg, cval_ptr, cid_ptr, cnt_ptr, tc_ptr,
                     sm_ptr, ss_ptr, scratch_ptr, sid_ptr, tok_ptr, HAS_MASK: tl.constexpr, NCP: tl.constexpr, CAND: tl.constexpr,
                     KMAX: tl.constexpr, KP: tl.constexpr, JB: tl.constexpr, BLOCK: tl.constexpr,
                     DRAW: tl.constexpr, KD: tl.constexpr, SEG: tl.constexpr, LANES: tl.constexpr,
                     FAST: tl.constexpr):
    """Program (row): tau of a candidate-path row from its segments' candidates, and path[row]: the number of
    candidates kept (>= 1), -1 (a segment overflowed: the exact row-wide bisection ran here), -2 (no filter:
    tau = -inf) or -3 (filters the candidate path does not take: the histogram path writes tau).
    The candidates >= t_row = max_c t_c are exactly the row's tokens >= t_row, a superset of the top-k set K.
    t_k = their k-th largest (K = {z >= t_k}), then top-p on K: all pairs when |K| <= KP (each member's mass of
    strictly larger members, against p * mass(K)), a bisection otherwise.
    DRAW: also draw the row's token from the kept set when |K| <= KD (tok[row], else -2: the sampling pass draws
    it), by the lane rule of kernels/sampling.py restricted to the kept tokens (`_draw_kept`)."""
    row = tl.program_id(0).to(tl.int64)
    is_c, top_k, p_only = _is_cand_row(row, V, greedy_ptr, top_k_ptr, top_p_ptr, KMAX)
    top_p = tl.load(top_p_ptr + row)
    path = -2
    tau = float("-inf")
    tok = -2
    if is_c:
        c = tl.arange(0, NCP)
        okc = c < n_seg
        cnt = tl.load(cnt_ptr + row * n_seg + c, mask=okc, other=0)
        if tl.max(cnt, 0) <= CAND:
            t_row = tl.max(tl.load(tc_ptr + row * n_seg + c, mask=okc, other=float("-inf")), 0)
            # all slots as one flat block (slot idx // CAND, entry idx % CAND)
            idx = tl.arange(0, NCP * CAND)
            ci = idx // CAND
            ok = (ci < n_seg) & (idx % CAND < tl.load(cnt_ptr + row * n_seg + ci, mask=ci < n_seg, other=0))
            z = tl.load(cval_ptr + row * n_seg * CAND + idx, mask=ok, other=float("-inf"))
            z = tl.where(z >= t_row, z, float("-inf"))
            live = z > float("-inf")
            n_live = tl.sum(live.to(tl.int32), 0)
            path = tl.where(n_live > 0, n_live, -2)                  # -2: nothing allowed, tau = -inf
            if n_live > 0:
                m = tl.max(z, 0)
                t_k = tl.min(tl.where(live, z, float("inf")), 0)
                if n_live > top_k:
                    t_k = _kth_largest(z, top_k, t_k, 12)
                in_k = z >= t_k
                e = tl.where(in_k, tl.exp(z - m), 0.0)
                sk = tl.sum(e, 0)
                tau = t_k
                ik = in_k.to(tl.int32)
                nk = tl.sum(ik, 0)
                lim_mass = sk                    # top-p is relative to the top-k set's mass ...
                if p_only:                       # ... or to the whole row's: K must then carry >= p of it
                    smc = tl.load(sm_ptr + row * n_seg + c, mask=okc, other=float("-inf"))
                    ssc = tl.load(ss_ptr + row * n_seg + c, mask=okc, other=0.0)
                    lim_mass = tl.sum(tl.where(smc > float("-inf"), ssc * tl.exp(smc - m), 0.0), 0)
                    if sk < top_p * lim_mass * 1.0001:         # (margin for the sums' rounding)
                        path = -3                # the kept set may reach below K: the histogram path decides
                        nk = KP + 1
                        top_p = 2.0
                if nk <= KP:
                    # compact K into this row's scratch (values, and ids for the draw)
                    at = tl.cumsum(ik, 0) - 1
                    tl.store(scratch_ptr + row * KP + at, z, mask=in_k)
                    if DRAW:
                        tl.store(sid_ptr + row * KP + at, tl.load(cid_ptr + row * n_seg * CAND + idx, mask=in_k,
                                                                  other=0), mask=in_k)
                    tl.debug_barrier()                              # the block's stores before its loads
                    i = tl.arange(0, KP)
                    zk = tl.load(scratch_ptr + row * KP + i, mask=i < nk, other=float("-inf"))
                    if top_p < 1.0:
                        mass = tl.zeros([KP], tl.float32)
                        for j0 in tl.static_range(0, KP, JB):
                            jj = j0 + tl.arange(0, JB)
                            zj = tl.load(scratch_ptr + row * KP + jj, mask=jj < nk, other=float("-inf"))
                            ej = tl.where(zj > float("-inf"), tl.exp(zj - m), 0.0)
                            mass += tl.sum(tl.where(zj[None, :] > zk[:, None], ej[None, :], 0.0), 1)
                        keep = (zk > float("-inf")) & (mass < top_p * lim_mass)
                        tau = tl.min(tl.where(keep, zk, float("inf")), 0)
                    if DRAW:
                        if nk <= KD:                                # pairs over a [KD, KD] block
                            d = tl.arange(0, KD)
                            zd = tl.load(scratch_ptr + row * KP + d, mask=d < nk, other=float("-inf"))
                            idd = tl.load(sid_ptr + row * KP + d, mask=d < nk, other=0)
                            tok = _draw_kept(tl.where(zd >= tau, zd, float("-inf")), idd,
                                             tl.load(keys_ptr + row).to(tl.uint32), SEG, LANES, FAST)
                elif top_p < 1.0:
                    tau = _bisect_block(tl.where(in_k, z, float("-inf")), e, t_k, m, V + 1, top_p, lim_mass)
        else:
            path = -1
            mrow = -1
            if HAS_MASK:
                mrow = tl.load(mask_rows_ptr + row)
            tau = _bisect_tau(logits_ptr, row, V, tl.load(inv_t_ptr + row), top_k, top_p, bitmask_ptr, mrow,
                              bitmask_stride, HAS_MASK, BLOCK)
    elif (tl.load(greedy_ptr + row) == 0) & (((top_k > 0) & (top_k < V)) | (top_p < 1.0)):
        path = -3
    if path != -3:
        tl.store(tau_ptr + row, tau)
    tl.store(path_ptr + row, path)
    if DRAW:
        tl.store(tok_ptr + row, tok)


@triton.jit
def _draw_kept(z, ids, key, SEG: tl.constexpr, LANES: tl.constexpr, FAST: tl.constexpr):
    """The token the sampling pass with tau would draw, from the kept tokens alone (z [KP], -inf padding; ids):
    lane g = (id // SEG) * LANES + id % LANES, place in its lane k = id % SEG // LANES; per lane M_g, weights
    w = 2^(z log2 e - M_g log2 e), mass S_g, inverse-CDF pick with u_g (first kept k whose running sum > the
    target), score M_g + ln S_g + G_g; the best lane's pick (lowest id on equal scores). All by pairs over the
    block: a token's lane-mates are the kept tokens with its lane number (lanes with nothing kept score -inf, as
    in the pass). Sums run in another order than the pass's in-thread running sums (a draw can differ from the
    pass's only where u_g * S_g falls within rounding of a boundary)."""
    live = z > float("-inf")
    g = (ids // SEG) * LANES + ids % LANES
    kk = (ids % SEG) // LANES
    same = (g[:, None] == g[None, :]) & live[None, :]                       # [i, j]: j is a kept lane-mate of i
    zj = z[None, :]
    mg = tl.max(tl.where(same, zj, float("-inf")), 1)
    ref = tl.where(mg > float("-inf"), mg, 0.0) * 1.4426950408889634
    from_sampling_exp2 = exp2_w(z * 1.4426950408889634 - ref, FAST)
    w = tl.where(live, from_sampling_exp2, 0.0)
    wj = w[None, :]
    sg = tl.sum(tl.where(same, wj, 0.0), 1)
    cdf = tl.sum(tl.where(same & (kk[None, :] <= kk[:, None]), wj, 0.0), 1)
    target = _below(rng.uniform_tl(key, g + 1073741824) * sg, sg)                 # U_ID + g
    above = cdf > target
    # the pick of lane g: the lane-mate above the target with the smallest k
    earlier = tl.sum((same & (kk[None, :] < kk[:, None]) & (cdf[None, :] > target[:, None])).to(tl.int32), 1)
    pick = live & above & (earlier == 0)
    score = tl.where(pick, mg + tl.log(tl.maximum(sg, 1e-30)) + rng.gumbel_tl(key, g + 1610612736, FAST), float("-inf"))
    best = tl.max(score, 0)
    tok = tl.min(tl.where((score == best) & pick, ids, 2147483647), 0)
    return tl.where(best > float("-inf"), tok, -1)


def needs_histogram_path(params, V: int, kmax: int = KMAX) -> bool | None:
    """Does some row filter in a way the candidate path does not take (top-p alone, top_k > kmax)? None when the
    parameters live on a GPU (unknown without a sync: the histogram kernels then run and skip solved rows)."""
    if params.top_k.is_cuda:
        return None
    k, p = params.top_k, params.top_p
    filt = (((k > 0) & (k < V)) | (p < 1)) & ~params.greedy
    cand = (k > 0) & (k <= kmax) & (k < V)
    return bool((filt & ~cand).any())


def thresholds_triton(logits, params, bitmask, mrows, block=1024, cmax=CMAX, chunk=CHUNK, histogram=None) -> torch.Tensor:
    """tau [R] fp32 for every row (see thresholds_and_paths)."""
    return thresholds_and_paths(logits, params, bitmask, mrows, block, cmax, chunk, histogram=histogram)[0]


def thresholds_and_paths(logits, params, bitmask, mrows, block=1024, cmax=CMAX, chunk=CHUNK, stages=6,
                         tau_warps=8, histogram=None, kmax=KMAX, cand=CAND, seg_steps=SEG_STEPS, draw=None):
    """(tau [R] fp32, path int32 [R]) for every row (params: sampling.RowParams; mrows: int64 [R] when bitmask
    is given). path: >= 1 the candidates a row's tau came from, -1 an exact bisection fallback, -2 no filtering.
    Rows with 0 < top_k <= kmax: the candidate path, two launches (`_cand_kernel`: one read of the row,
    `_cand_tau_kernel`). Other filtered rows: the histogram path, four launches (skipped when the host knows no
    row needs it: histogram=False; None asks needs_histogram_path). No host synchronisation.
    draw=(seg, lanes): the merge also draws candidate-path rows' tokens by the sampling rule with that layout;
    the result gains a third entry, tok int32 [R] (-2 where the sampling pass must draw).
    cmax, chunk, kmax, cand (powers of two) are parameters so that tests can force fallbacks and several
    chunks on a small vocabulary; stages < 6 stops after that many launches (benchmarks time each stage by
    differences; the result is then unfinished)."""
    R, V = logits.shape
    dev = logits.device
    tau = empty((R,), torch.float32, dev)
    path = empty((R,), torch.int32, dev)
    tok = empty((R,), torch.int32, dev) if draw else path
    done = (lambda: (tau, path, tok)) if draw else (lambda: (tau, path))
    if R == 0:
        return done()
    has_mask = bitmask is not None
    chunk = min(chunk, max(16, triton.next_power_of_2(V)))
    cmax = min(cmax, max(16, triton.next_power_of_2(V)))          # there are never more candidates than tokens
    n_chunks = triton.cdiv(V, chunk)
    greedy = params.greedy.to(torch.int8)
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else path
    stride = bitmask.stride(0) if has_mask else 0
    # candidate path: segments of `chunk` tokens as [lanes, chunk / lanes] blocks (2 warps hold 256 lanes)
    lanes = min(256, chunk)
    cval = torch.empty((R, n_chunks, cand), dtype=torch.float32, device=dev)
    cid = torch.empty((R, n_chunks, cand), dtype=torch.int32, device=dev) if draw else cval
    cnt = torch.empty((R, n_chunks), dtype=torch.int32, device=dev)
    tc = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    sm = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    ss = torch.empty_like(sm)
    _cand_kernel[(R, n_chunks)](logits, params.inv_temperature, greedy, params.top_k, params.top_p, bm, mr, stride, V,
                                n_chunks, cval, cid, cnt, tc, sm, ss, HAS_MASK=has_mask, LANES=lanes, LW=chunk // lanes, CAND=cand,
                                KMAX=kmax, STEPS=seg_steps, IDS=bool(draw), FAST=not INTERPRETING, num_warps=2)
    if stages < 2:
        return done()
    scratch = torch.empty((R, KP), dtype=torch.float32, device=dev)
    sid = torch.empty((R, KP), dtype=torch.int32, device=dev) if draw else scratch
    dseg, dlanes = draw if draw else (4096, 256)
    _cand_tau_kernel[(R,)](logits, tau, path, params.inv_temperature, greedy, params.top_k, params.top_p, params.keys,
                           bm, mr, stride, V, n_chunks, cval, cid, cnt, tc, sm, ss, scratch, sid, tok,
                           HAS_MASK=has_mask,
                           NCP=max(2, triton.next_power_of_2(n_chunks)), CAND=cand, KMAX=kmax, KP=KP, JB=32,
                           BLOCK=min(block, triton.next_power_of_2(V)), DRAW=bool(draw), KD=KD, SEG=dseg, LANES=dlanes,
                           FAST=not INTERPRETING, num_warps=8)
    if histogram is None:
        histogram = needs_histogram_path(params, V, kmax)
    if histogram is False or stages < 3:
        return done()
    consts = dict(INV_W=INV_W, BIN_LIMIT=BIN_LIMIT)
    cmax_c = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    csum_c = torch.empty_like(cmax_c)
    cbin_c = torch.empty((R, n_chunks), dtype=torch.int32, device=dev)
    hist = torch.empty((R, n_chunks, NB), dtype=torch.int32, device=dev)
    m = torch.empty((R,), dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    low = torch.empty((R,), dtype=torch.int32, device=dev)
    ncand = torch.empty((R,), dtype=torch.int32, device=dev)
    offsets = torch.empty((R, n_chunks), dtype=torch.int32, device=dev)
    cand_h = torch.empty((R, cmax), dtype=torch.float32, device=dev)
    _hist_kernel[(R, n_chunks)](logits, params.inv_temperature, greedy, params.top_k, params.top_p, path, bm, mr,
                                stride, V, n_chunks, cmax_c, csum_c, cbin_c, hist, HAS_MASK=has_mask, CHUNK=chunk,
                                NB=NB, num_warps=8, **consts)
    if stages < 4:
        return done()
    _select_kernel[(R,)](greedy, params.top_k, params.top_p, path, V, n_chunks, cmax_c, csum_c, cbin_c, hist, m, s,
                         low, ncand, offsets, NCP=max(2, triton.next_power_of_2(n_chunks)), NB=NB, CMAX=cmax,
                         num_warps=8, **consts)
    if stages < 5:
        return done()
    glanes = min(GATHER_LANES, chunk)
    _gather_kernel[(R, n_chunks)](logits, params.inv_temperature, bm, mr, stride, V, n_chunks, low, ncand, offsets,
                                  cand_h, HAS_MASK=has_mask, LANES=glanes, LW=chunk // glanes, CMAX=cmax, num_warps=4,
                                  **consts)
    if stages < 6:
        return done()
    _tau_kernel[(R,)](logits, tau, params.inv_temperature, greedy, params.top_k, params.top_p, path, bm, mr, stride,
                      V, m, s, ncand, cand_h, HAS_MASK=has_mask, BLOCK=min(block, triton.next_power_of_2(V)),
                      CMAX=cmax, SMALL=min(SMALL, cmax), num_warps=tau_warps)
    path = torch.where(path == -3, ncand, path)
    return (tau, path, tok) if draw else (tau, path)
