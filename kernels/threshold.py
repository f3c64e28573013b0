"""The exact top-k/top-p threshold tau of every row, in a few parallel passes instead of a 32-step bisection.

Definition (kernels/sampling.py): token v is kept iff fewer than k allowed tokens have z > z_v and the softmax
mass of the tokens with z > z_v is < p; the kept set is {z >= tau}. Rows without filters (and greedy rows, and
rows with nothing allowed) get tau = -inf.

Method: bucket z on a fixed grid of width 1/INV_W (bin a = floor(z * INV_W), exact: INV_W is a power of two).
A token in a lower bin than another has a strictly smaller z, so once the tokens in the top bins are at least k,
or certainly carry mass >= p (each token of bin a has exp(z - m) >= exp(a / INV_W - m)), every token below those
bins is dropped. Only the tokens of the top bins (the candidates; a few dozen for top_k ~ 50 on real logits) are
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

from .backend import empty

INV_W = 32.0          # bins per unit of z: a token's mass is known to within a factor e^(1/32) from its bin
NB = 512              # bins per chunk histogram (the last one collects everything lower): 16 units of z
CHUNK = 4096          # tokens per (row, chunk) program in passes 1 and 3
CMAX = 4096           # most candidates a row may have on the fast path
SMALL = 256           # candidates up to this many take the short-block variant of the last pass
GATHER_LANES = 512    # lanes of the candidate pass's [lanes, CHUNK / lanes] blocks
BIN_LIMIT = 1 << 24   # |z * INV_W| is clamped here (bin numbers and bin edges stay exact in fp32)


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
def _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr):
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    filt = (((top_k > 0) & (top_k < V)) | (top_p < 1.0)) & (tl.load(greedy_ptr + row) == 0)
    return filt, tl.where(top_k > 0, top_k, V + 1), top_p


@triton.jit
def _bin(z, INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr):
    """floor(z * INV_W) as int32, clamped to +-BIN_LIMIT (monotone in z; -inf goes to -BIN_LIMIT)."""
    x = tl.minimum(tl.maximum(z * INV_W, -BIN_LIMIT), BIN_LIMIT)
    return tl.floor(x).to(tl.int32)


@triton.jit
def _hist_kernel(logits_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, bitmask_ptr, mask_rows_ptr,
                 bitmask_stride, V, n_chunks, cmax_ptr, csum_ptr, cbin_ptr, hist_ptr,
                 HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr, INV_W: tl.constexpr,
                 BIN_LIMIT: tl.constexpr):
    """Program (row, chunk): chunk max, sum exp(z - chunk max), and counts per bin below the chunk's top bin
    (bin i = top bin - i; bin NB-1 collects the rest). Rows without filters write nothing (nobody reads it)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr)
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
def _select_kernel(greedy_ptr, top_k_ptr, top_p_ptr, V, n_chunks, cmax_ptr, csum_ptr, cbin_ptr, hist_ptr,
                   m_ptr, s_ptr, low_ptr, ncand_ptr, offset_ptr,
                   NCP: tl.constexpr, NB: tl.constexpr, INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr,
                   CMAX: tl.constexpr):
    """Program (row): row max m and sum s; the lowest candidate bin; candidates per chunk -> output offsets.
    ncand: -2 = no filtering (tau = -inf), -1 = fall back to the bisection, >= 1 = candidates on the fast path."""
    row = tl.program_id(0).to(tl.int64)
    filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr)
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
            done = ((cum_count >= top_k) | (cum_mass >= top_p * s)) & (b < NB - 1)
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
def _gather_kernel(logits_ptr, inv_t_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_chunks, low_ptr,
                   ncand_ptr, offset_ptr, cand_ptr, HAS_MASK: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                   INV_W: tl.constexpr, BIN_LIMIT: tl.constexpr, CMAX: tl.constexpr):
    """Program (row, chunk): the chunk's candidates (z in a bin >= the lowest candidate bin), written compactly
    at the chunk's offset in lane-major order (one scan over the lanes' counts, then a running count inside each
    lane, held by one thread)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(ncand_ptr + row) > 0:
        mrow = -1
        if HAS_MASK:
            mrow = tl.load(mask_rows_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        start = chunk * (LANES * LW)
        if start + LANES * LW <= V:
            z, pos = lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK,
                                  True, LANES, LW)
        else:
            z, pos = lane_block_z(logits_ptr, bitmask_ptr, row, start, V, inv_t, mrow, bitmask_stride, HAS_MASK,
                                  False, LANES, LW)
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
def _bisect_tau(logits_ptr, row, V, inv_t, top_k, top_p, bitmask_ptr, mrow, bitmask_stride,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """The fallback: statistics pass, then bisection on the ordered fp32 bits of tau (<= 32 passes)."""
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
        # keep(t): count(z > t) < k and mass(z > t) < p; monotone in t, true at t = max
        cnt, mass = _count_mass_above(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, zmin, m, s,
                                      HAS_MASK, BLOCK)
        if (cnt < top_k) & (mass < top_p):
            tau = zmin
        else:
            lo = _ordered(zmin.to(tl.int32, bitcast=True)).to(tl.int64)      # keep(lo) is false
            hi = _ordered(m.to(tl.int32, bitcast=True)).to(tl.int64)         # keep(hi) is true
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                t = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
                cnt, mass = _count_mass_above(logits_ptr, row, V, inv_t, bitmask_ptr, mrow, bitmask_stride, t,
                                              m, s, HAS_MASK, BLOCK)
                if (cnt < top_k) & (mass < top_p):
                    hi = mid
                else:
                    lo = mid
            tau = _ordered(hi.to(tl.int32)).to(tl.float32, bitcast=True)
    return tau


@triton.jit
def _bisect_candidates(cand_ptr, n, m, s, top_k, top_p, BLOCK: tl.constexpr):
    """tau from the n candidates held in registers: keep(t) is exact for t >= the smallest candidate (every other
    token is smaller), it only changes at candidate values, and it is true at t = m. Bisection on the ordered
    fp32 bits between the smallest candidate and m (<= 32 steps, each a compare and two block reductions)."""
    i = tl.arange(0, BLOCK)
    z = tl.load(cand_ptr + i, mask=i < n, other=float("-inf"))
    e = tl.where(z > float("-inf"), tl.exp(z - m), 0.0)
    zmin = tl.min(tl.where(z > float("-inf"), z, float("inf")), 0)
    above = z > zmin
    tau = zmin
    if (tl.sum(above.to(tl.int32), 0) >= top_k) | (tl.sum(tl.where(above, e, 0.0), 0) / s >= top_p):
        lo = _ordered(zmin.to(tl.int32, bitcast=True)).to(tl.int64)          # keep(lo) is false
        hi = _ordered(m.to(tl.int32, bitcast=True)).to(tl.int64)             # keep(hi) is true
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            t = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
            above = z > t
            if (tl.sum(above.to(tl.int32), 0) < top_k) & (tl.sum(tl.where(above, e, 0.0), 0) / s < top_p):
                hi = mid
            else:
                lo = mid
        tau = _ordered(hi.to(tl.int32)).to(tl.float32, bitcast=True)
    return tau


@triton.jit
def _direct_candidates(cand_ptr, n, m, s, top_k, top_p, BLOCK: tl.constexpr, JB: tl.constexpr):
    """tau from n <= BLOCK candidates by the definition, without a serial search: for every candidate v the count
    and the mass of candidates with z > z_v (blocks of JB columns of the all-pairs comparison, independent of
    each other), kept iff count < k and mass < p; tau = the smallest kept candidate (the largest one is always
    kept). Exact on the candidates for the same reason as _bisect_candidates."""
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
    keep = (cnt < top_k) & (mass / s < top_p) & (z > float("-inf"))
    return tl.min(tl.where(keep, z, float("inf")), 0)


@triton.jit
def _tau_kernel(logits_ptr, tau_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, bitmask_ptr, mask_rows_ptr,
                bitmask_stride, V, m_ptr, s_ptr, ncand_ptr, cand_ptr,
                HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, CMAX: tl.constexpr, SMALL: tl.constexpr):
    """Program (row): tau from the candidates (fast path) or from the bisection (fallback)."""
    row = tl.program_id(0).to(tl.int64)
    filt, top_k, top_p = _row_filters(row, V, greedy_ptr, top_k_ptr, top_p_ptr)
    ncand = tl.load(ncand_ptr + row)
    tau = float("-inf")
    if ncand > 0:
        if ncand <= SMALL:                          # the usual case (top_k ~ 50): all pairs, no serial search
            tau = _direct_candidates(cand_ptr + row * CMAX, ncand, tl.load(m_ptr + row), tl.load(s_ptr + row),
                                     top_k, top_p, SMALL, 32)
        else:
            tau = _bisect_candidates(cand_ptr + row * CMAX, ncand, tl.load(m_ptr + row), tl.load(s_ptr + row),
                                     top_k, top_p, CMAX)
    elif ncand == -1:
        mrow = -1
        if HAS_MASK:
            mrow = tl.load(mask_rows_ptr + row)
        tau = _bisect_tau(logits_ptr, row, V, tl.load(inv_t_ptr + row), top_k, top_p, bitmask_ptr, mrow,
                          bitmask_stride, HAS_MASK, BLOCK)
    tl.store(tau_ptr + row, tau)


def thresholds_triton(logits, params, bitmask, mrows, block=1024, cmax=CMAX, chunk=CHUNK) -> torch.Tensor:
    """tau [R] fp32 for every row (see thresholds_and_paths)."""
    return thresholds_and_paths(logits, params, bitmask, mrows, block, cmax, chunk)[0]


def thresholds_and_paths(logits, params, bitmask, mrows, block=1024, cmax=CMAX, chunk=CHUNK, stages=4,
                         tau_warps=8):
    """(tau [R] fp32, path int32 [R]) for every row; path: -2 no filtering, -1 bisection fallback, n >= 1 the
    fast path with n candidates (params: sampling.RowParams; mrows: int64 [R] when bitmask is given).
    Four launches, no host synchronisation; rows without filters cost a few loads each. cmax and chunk (powers
    of two) are parameters so that tests can force the fallback and several chunks on a small vocabulary;
    stages < 4 stops after that many launches (benchmarks time each stage by differences; the result is then
    unfinished)."""
    R, V = logits.shape
    dev = logits.device
    tau = empty((R,), torch.float32, dev)
    if R == 0:
        return tau, torch.zeros((0,), dtype=torch.int32, device=dev)
    has_mask = bitmask is not None
    chunk = min(chunk, max(16, triton.next_power_of_2(V)))
    cmax = min(cmax, max(16, triton.next_power_of_2(V)))          # there are never more candidates than tokens
    n_chunks = triton.cdiv(V, chunk)
    greedy = params.greedy.to(torch.int8)
    cmax_c = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    csum_c = torch.empty_like(cmax_c)
    cbin_c = torch.empty((R, n_chunks), dtype=torch.int32, device=dev)
    hist = torch.empty((R, n_chunks, NB), dtype=torch.int32, device=dev)
    m = torch.empty((R,), dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    low = torch.empty((R,), dtype=torch.int32, device=dev)
    ncand = torch.empty((R,), dtype=torch.int32, device=dev)
    offsets = torch.empty((R, n_chunks), dtype=torch.int32, device=dev)
    cand = torch.empty((R, cmax), dtype=torch.float32, device=dev)
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else ncand
    stride = bitmask.stride(0) if has_mask else 0
    consts = dict(INV_W=INV_W, BIN_LIMIT=BIN_LIMIT)
    _hist_kernel[(R, n_chunks)](logits, params.inv_temperature, greedy, params.top_k, params.top_p, bm, mr, stride,
                                V, n_chunks, cmax_c, csum_c, cbin_c, hist, HAS_MASK=has_mask, CHUNK=chunk, NB=NB,
                                num_warps=8, **consts)
    if stages < 2:
        return tau, ncand
    _select_kernel[(R,)](greedy, params.top_k, params.top_p, V, n_chunks, cmax_c, csum_c, cbin_c, hist, m, s, low,
                         ncand, offsets, NCP=max(2, triton.next_power_of_2(n_chunks)), NB=NB, CMAX=cmax,
                         num_warps=8, **consts)
    if stages < 3:
        return tau, ncand
    lanes = min(GATHER_LANES, chunk)
    _gather_kernel[(R, n_chunks)](logits, params.inv_temperature, bm, mr, stride, V, n_chunks, low, ncand, offsets,
                                  cand, HAS_MASK=has_mask, LANES=lanes, LW=chunk // lanes, CMAX=cmax, num_warps=4,
                                  **consts)
    if stages < 4:
        return tau, ncand
    _tau_kernel[(R,)](logits, tau, params.inv_temperature, greedy, params.top_k, params.top_p, bm, mr, stride, V,
                      m, s, ncand, cand, HAS_MASK=has_mask, BLOCK=min(block, triton.next_power_of_2(V)), CMAX=cmax,
                      SMALL=min(SMALL, cmax), num_warps=tau_warps)
    return tau, ncand
