"""Top-p alone (0 < p < 1, no top-k) by rejection: proposals from the full softmax, kept iff inside the top-p set.

Rule (part of the sampling contract, kernels/sampling.py; a row is "top-p alone" when it is sampled, top-k is off
and p < 1): proposals j = 0, 1, ..., NMAX - 1 are i.i.d. draws from the UNRESTRICTED processed softmax (mask and
temperature, no top-p), each by the sampling rule's lane draw (kernels/sampling.py) with its own row key
(`proposal_keys`: key 0 is the row key, so proposal 0 is the plain draw). The token is the first proposal v
inside the top-p set T = {v : mass(z > z_v) < p * s} = {z >= tau}; if none of the NMAX is, the token is the lane
draw restricted to T with key NMAX (today's rule with tau, on an independent key).
Exact: the proposals are i.i.d. with P(v) = e^z_v / s, and the first of them to land in T is distributed as the
proposal law conditioned on T: P(v | v in T) = e^z_v / mass(T) = q_v (the stopping index depends only on
whether earlier proposals landed in T, which is independent of the later ones). The fallback draw has law q too
and is independent of the proposals (other key), so the mixture over "accepted at j" and "none accepted" is q.
Each proposal lands in T with probability mass(T) / s >= p, so the fallback runs with probability
<= (1 - p)^NMAX (p = 0.9: 1e-8 per row; p = 0.5: 0.4%). The NMAX is part of the rule (it decides the token);
how many proposals the fast path computes (PROPOSALS) is not.
It draws other tokens for a seed than the tau-first rule (sessions <= 6) did; the speculative bonus token
follows the same rule (kernels/speculative.py), so the bonus is still exactly the plain draw.

Work on a GPU (no tau first, no histogram): pass 1 is the sampling pass itself computing PROPOSALS draws per
program (the lane weights and running sums are shared; each proposal costs a compare and an add per token and a
hash, a log and a block reduction per lane), the program's max z and (LANE_SKIP) every lane's max and mass;
pass 2 (`_above_kernel`, per (row, segment), only top-p-alone rows) sums, in fp64 across lanes, the mass
exp(z - m) of the segment and the mass above each proposal, reading only the lanes whose max exceeds the
smallest proposal's z (the others hold no token above any proposal: on LLM-like rows, whose proposals sit among
the few top tokens, almost none; the segment's mass comes from the lane masses); with FUSE_FINISH the row's last
pass-2 program (a per-row count) takes the first proposal whose mass above is < p * s (`_row_token`), otherwise
a third launch does (`_reject_finish_kernel`). A row whose PROPOSALS proposals all miss runs the rest of the rule
in that program (loops over the row: proposals PROPOSALS .. NMAX - 1, then the row-wide tau bisection and the
restricted draw): exact, slow, rare.
"""
import torch
import triton
import triton.language as tl

from . import rng
from .backend import empty
from .threshold import (NEG_INF_KEY, _below, _bisect_tau, exp2_w, lane_block, lane_score, load_z, pack_lanes,
                        row_block_z, segment_pack)

NMAX = 8              # proposals of the rule (part of the contract: it decides the token)
PROPOSALS = 4         # proposals the sampling pass computes (the finish computes the rest when all miss)
KEY_MUL = 0x632BE5AB  # proposal j >= 1 key: lowbias32(row key ^ j * KEY_MUL)
MIN_PACKED = -9223372036854775807
MIN_PACKED_C = tl.constexpr(MIN_PACKED)
NEG_INF_KEY_C = tl.constexpr(NEG_INF_KEY)
ABOVE_WARPS = 2       # warps of the mass-above pass ([LANES, LW] blocks: 4 lanes per thread, 16-byte loads)
FINISH_WARPS = 4
# R2 (H200, whole top-p call, B=64 / 256, flat p 0.9 and peaked p 0.95 rows; the device-side parameter view then
# still cost ~15 us in every row): defaults 55.4 / 151.9 and 53.8 / 142.3 us; every lane read 52.5 / 141.8 and
# 52.3 / 136.6; the finish launched apart 53.9 / 135.8 and 52.0 / 128.0; the mass-above pass at 4 warps 69.2 /
# 193.0 and 67.4 / 178.4; 2 proposals 120.6 / 63.6 at B=64 (flat rows then often reach the finish's loops), 6
# proposals 67.4 / 65.3. So: every lane read, the finish apart, 2 warps, 4 proposals.
LANE_SKIP = False     # the mass-above pass reads only lanes above the smallest proposal (lane statistics from the pass)
FUSE_FINISH = False   # the mass-above pass also finishes (its row's last program): one launch fewer
STAGES = 2            # benchmarks time the stages by differences: 0 stops after the pass, 1 after the mass above


def proposal_keys(keys: torch.Tensor, j: int) -> torch.Tensor:
    """Row keys (int64 holding uint32) of proposal j (the row keys themselves for j = 0)."""
    if j == 0:
        return keys
    return rng.mix32(keys ^ ((j * KEY_MUL) & rng.MASK32))


def p_alone_rows(params, V: int) -> torch.Tensor:
    """bool [R]: sampled rows with top-k off and p < 1 (params: sampling.RowParams, any device)."""
    k = params.top_k
    return ~params.greedy.bool() & ((k <= 0) | (k >= V)) & (params.top_p < 1)


@triton.jit
def proposal_key_tl(key, j):
    """Triton twin of `proposal_keys` for j >= 1 (j: an int32 scalar)."""
    return rng._mix32_tl(key ^ (j.to(tl.uint32) * 0x632BE5AB))


@triton.jit
def is_p_alone(row, V, greedy_ptr, top_k_ptr, top_p_ptr, FROM_TEMP: tl.constexpr = False):
    """Is row (or request) `row` top-p alone? FROM_TEMP: greedy_ptr holds temperatures (<= 0: greedy)."""
    top_k = tl.load(top_k_ptr + row)
    if FROM_TEMP:
        sampled = tl.load(greedy_ptr + row) > 0
    else:
        sampled = tl.load(greedy_ptr + row) == 0
    return sampled & ((top_k <= 0) | (top_k >= V)) & (tl.load(top_p_ptr + row) < 1.0)


@triton.jit
def store_proposals(x, lane, pos, start, seg, inv_t, greedy, key, out_ptr, HAS_TAU: tl.constexpr,
                    LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr, NP: tl.constexpr, lane_ptr=None,
                    n_lanes=0, LANE_STATS: tl.constexpr = False):
    """The sampling pass's per-program work with NP proposals (threshold.segment_pack for each): out_ptr[j] = the
    packed best lane of proposal j (greedy rows: out_ptr[0] only). The lane weights, running sums and masses are
    computed once; each proposal adds its in-lane pick, its Gumbel score and one block reduction. LANE_STATS:
    every lane's max z and mass sum exp(z - max) stored at lane_ptr[g] and lane_ptr[n_lanes + g] (the mass-above
    pass then reads only the lanes that can hold tokens above a proposal)."""
    xm = tl.max(x, 1)
    if greedy:
        tl.store(out_ptr, segment_pack(x, lane, pos, start, seg, inv_t, greedy, key, HAS_TAU, LANES, LW, FAST))
    else:
        c = 1.4426950408889634
        m = xm
        if not HAS_TAU:
            c = inv_t * 1.4426950408889634
            m = xm * inv_t
        ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
        gid = seg * LANES + lane
        w = exp2_w(x * c - ref[:, None], FAST)
        cdf = tl.cumsum(w, 1)
        k = tl.arange(0, LW)[None, :]
        s = tl.max(tl.where(k == LW - 1, cdf, float("-inf")), 1)
        if LANE_STATS:
            tl.store(lane_ptr + gid, m)
            tl.store(lane_ptr + n_lanes + gid, s)
        for j in tl.static_range(NP):
            kj = key
            if j > 0:
                kj = proposal_key_tl(key, tl.full([], j, tl.int32))
            target = _below(rng.uniform_tl(kj, gid + 1073741824) * s, s)          # U_ID + g
            kk = tl.sum((cdf <= target[:, None]).to(tl.int32), 1)
            tl.store(out_ptr + j, pack_lanes(lane_score(m, s, kj, gid, FAST),
                                             start + tl.minimum(kk, LW - 1) * LANES + lane))


@triton.jit
def _unpack(best):
    return 4294967295 - (best & 4294967295)


@triton.jit
def _proposal(packed_ptr, row, n_prog, j, NP: tl.constexpr, NPP: tl.constexpr):
    """(best packed, token) of proposal j of a row: the max over the row's programs."""
    i = tl.arange(0, NPP)
    best = tl.max(tl.load(packed_ptr + (row * n_prog + i) * NP + j, mask=i < n_prog, other=MIN_PACKED_C), 0)
    return best, _unpack(best)



@triton.jit
def _above_kernel(logits_ptr, packed_ptr, pmax_ptr, part_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr,
                  bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, n_seg, lane_ptr, n_lanes,
                  HAS_MASK: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                  VEC: tl.constexpr, FAST: tl.constexpr, SKIP: tl.constexpr, out_ptr=None, keys_ptr=None,
                  done_ptr=None, cnt_ptr=None, DONE: tl.constexpr = False, FUSE: tl.constexpr = False,
                  NSP: tl.constexpr = 16, NMAX: tl.constexpr = 8, BLOCK: tl.constexpr = 1024, NPQ: tl.constexpr = 8):
    """Program (row, segment) of a top-p-alone row: part[row, segment] = (mass of the segment, mass above each
    proposal), as sum exp(z - m) (m: the row max from the pass's program maxima): fp32 inside a thread's lane
    (LW terms), fp64 across lanes. SKIP: only the lanes whose max (the pass's lane statistics) exceeds the
    smallest proposal's z are read (the others hold no token above any proposal), and the segment's mass comes
    from the lane masses. Other rows return at once. FUSE: the finish too, in one launch: the row's last program
    (a count per row; acq_rel, after a barrier: every part is visible to it) computes its token (`_row_token`)
    and resets the count; rows that are not top-p alone get theirs from their segment 0 program."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    alone = is_p_alone(row, V, greedy_ptr, top_k_ptr, top_p_ptr)
    if alone:
        i = tl.arange(0, NPP)
        m = tl.max(tl.load(pmax_ptr + row * n_prog + i, mask=i < n_prog, other=float("-inf")), 0)
        if m > float("-inf"):
            start = seg * (LANES * LW)
            inv_t = tl.load(inv_t_ptr + row)
            o = (row * n_seg + seg) * (NP + 1)
            if SKIP:
                lane = tl.arange(0, LANES)
                lok = lane < V - start
                lm = tl.load(lane_ptr + row * 2 * n_lanes + seg * LANES + lane, mask=lok, other=float("-inf"))
                lmass = tl.load(lane_ptr + (row * 2 + 1) * n_lanes + seg * LANES + lane, mask=lok, other=0.0)
                live = lm > float("-inf")
                tl.store(part_ptr + o, tl.sum(tl.where(live, lmass * tl.exp(lm - m), 0.0).to(tl.float64), 0))
                zmin = float("inf")
                for j in tl.static_range(NP):
                    _, tok = _proposal(packed_ptr, row, n_prog, j, NP, NPP)
                    zmin = tl.minimum(zmin, tl.load(logits_ptr + row * V + tok).to(tl.float32) * inv_t)
                pos = lane[:, None] + tl.arange(0, LW)[None, :] * LANES
                ok = (lm > zmin)[:, None] & (pos < V - start)
                x = tl.load(logits_ptr + row * V + start + pos, mask=ok, other=float("-inf")).to(tl.float32)
                if HAS_MASK:
                    mrow = tl.load(mask_rows_ptr + row)
                    w = tl.load(bitmask_ptr + mrow * bitmask_stride + (start + pos) // 32, mask=ok & (mrow >= 0),
                                other=-1)
                    x = tl.where(((w >> ((start + pos) % 32)) & 1) != 0, x, float("-inf"))
                z = x * inv_t
            else:
                z, pos = row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, start, V,
                                     bitmask_stride, HAS_MASK, LANES, LW, LANES, 0, VEC, FAST)
            e = tl.where(z > float("-inf"), tl.exp(z - m), 0.0)
            if SKIP:
                for j in tl.static_range(NP):
                    _, tok = _proposal(packed_ptr, row, n_prog, j, NP, NPP)
                    zj = tl.load(logits_ptr + row * V + tok).to(tl.float32) * inv_t
                    tl.store(part_ptr + o + 1 + j, tl.sum(tl.sum(tl.where(z > zj, e, 0.0), 1).to(tl.float64), 0))
            else:
                # every proposal's token in one reduction, their z in one load, and the segment's mass with the
                # masses above them in one fp64 reduction across lanes (a chain of block reductions made the pass
                # latency-bound: R2, ~23 us at B=64 for one read of the row)
                jj = tl.arange(0, NPQ)
                pk = tl.load(packed_ptr + (row * n_prog + i)[:, None] * NP + jj[None, :],
                             mask=(i < n_prog)[:, None] & (jj < NP)[None, :], other=MIN_PACKED_C)
                toks = _unpack(tl.max(pk, 0))
                zs = tl.load(logits_ptr + row * V + toks, mask=jj < NP, other=0.0).to(tl.float32) * inv_t
                col = tl.arange(0, NPQ)[None, :]
                acc = tl.where(col == 0, tl.sum(e, 1)[:, None], 0.0)
                for j in tl.static_range(NP):
                    zj = tl.sum(tl.where(jj == j, zs, 0.0), 0)
                    acc = tl.where(col == j + 1, tl.sum(tl.where(z > zj, e, 0.0), 1)[:, None], acc)
                tl.store(part_ptr + o + jj, tl.sum(acc.to(tl.float64), 0), mask=jj <= NP)
    if FUSE:
        last = seg == 0
        if alone:
            tl.debug_barrier()                                     # every thread's part stores before the count
            last = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel") == n_seg - 1
        if last:
            if alone:
                tl.store(cnt_ptr + row, 0)
            tl.store(out_ptr + row, _row_token(logits_ptr, packed_ptr, pmax_ptr, part_ptr, row, inv_t_ptr, greedy_ptr,
                                               top_k_ptr, top_p_ptr, keys_ptr, bitmask_ptr, mask_rows_ptr,
                                               bitmask_stride, V, n_prog, n_seg, done_ptr, DONE, HAS_MASK, NP, NPP,
                                               NSP, NMAX, LANES, LW, BLOCK, FAST, min(LANES, 64)))


@triton.jit
def rest_of_rule(logits_ptr, row, V, inv_t, top_p, key, m, lim, tau, bitmask_ptr, mrow, bitmask_stride,
                 HAS_MASK: tl.constexpr, NP: tl.constexpr, NMAX: tl.constexpr, LANES: tl.constexpr,
                 LW: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, KNOWN_TAU: tl.constexpr,
                 RPL: tl.constexpr = 128):
    """The rule past the first NP proposals, by loops over the row in this one program (rare: every proposal so
    far missed the top-p set): proposals NP .. NMAX - 1 (each a lane draw over the row, then its mass above in
    fp64 compared with lim = p * s, m the row max; KNOWN_TAU: z >= tau instead), then the draw restricted to
    z >= tau with key NMAX (tau from the row-wide bisection unless KNOWN_TAU). RPL: lanes per block of the loops
    (small for a program of few warps: the blocks stay in registers)."""
    tok = tl.full([], -2, tl.int64)
    j = tl.full([], NP, tl.int32)
    n_seg = tl.cdiv(V, LANES * LW)
    while (tok == -2) & (j < NMAX):
        kj = proposal_key_tl(key, j)
        best = tl.full([], MIN_PACKED_C, tl.int64)
        for cs in range(0, n_seg * (LANES // RPL)):
            c = cs // (LANES // RPL)
            lane, pos, x = lane_block(logits_ptr, bitmask_ptr, row, c * (LANES * LW), V, mrow, bitmask_stride,
                                      HAS_MASK, False, LANES, LW, RPL, cs % (LANES // RPL), 1, FAST)
            best = tl.maximum(best, segment_pack(x, lane, pos, c * (LANES * LW), c, inv_t, False, kj, False, LANES,
                                                 LW, FAST))
        t = _unpack(best)
        zt = tl.load(logits_ptr + row * V + t).to(tl.float32) * inv_t
        if KNOWN_TAU:
            tok = tl.where(zt >= tau, t, tok)
        else:
            above = tl.zeros([BLOCK], tl.float64)
            for start in range(0, V, BLOCK):
                z = load_z(logits_ptr, row, start + tl.arange(0, BLOCK), V, inv_t, bitmask_ptr, mrow, bitmask_stride,
                           HAS_MASK)
                above += tl.where(z > zt, tl.exp(z - m), 0.0).to(tl.float64)
            tok = tl.where(tl.sum(above, 0) < lim, t, tok)
        j += 1
    if tok == -2:
        if not KNOWN_TAU:
            tau = _bisect_tau(logits_ptr, row, V, inv_t, V + 1, top_p, bitmask_ptr, mrow, bitmask_stride, HAS_MASK,
                              BLOCK)
        kf = proposal_key_tl(key, tl.full([], NMAX, tl.int32))
        best = tl.full([], MIN_PACKED_C, tl.int64)
        for cs in range(0, n_seg * (LANES // RPL)):
            c = cs // (LANES // RPL)
            lane, pos, x = lane_block(logits_ptr, bitmask_ptr, row, c * (LANES * LW), V, mrow, bitmask_stride,
                                      HAS_MASK, False, LANES, LW, RPL, cs % (LANES // RPL), 1, FAST)
            z = x * inv_t
            best = tl.maximum(best, segment_pack(tl.where(z >= tau, z, float("-inf")), lane, pos, c * (LANES * LW),
                                                 c, inv_t, False, kf, True, LANES, LW, FAST))
        tok = tl.where((best >> 32) > NEG_INF_KEY_C, _unpack(best), -1)
    return tok


@triton.jit
def _row_token(logits_ptr, packed_ptr, pmax_ptr, part_ptr, row, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, keys_ptr,
               bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, n_seg, done_ptr, DONE: tl.constexpr,
               HAS_MASK: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr, NSP: tl.constexpr, NMAX: tl.constexpr,
               LANES: tl.constexpr, LW: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, RPL: tl.constexpr):
    """A row's token. Rows the top-k merge drew (DONE, done != -2) keep it; top-p-alone rows take their first
    proposal whose mass above is < p * s (sums of `_above_kernel`'s fp64 parts, loaded past L1: other programs
    of this launch may have written them), or the rest of the rule (`rest_of_rule`); other rows take proposal 0
    (the plain draw, or the draw restricted by tau). -1: nothing allowed."""
    tok = tl.full([], -2, tl.int64)
    if DONE:
        tok = tl.load(done_ptr + row)
    if tok == -2:
        if is_p_alone(row, V, greedy_ptr, top_k_ptr, top_p_ptr):
            i = tl.arange(0, NPP)
            m = tl.max(tl.load(pmax_ptr + row * n_prog + i, mask=i < n_prog, other=float("-inf")), 0)
            tok = tl.full([], -1, tl.int64)
            if m > float("-inf"):
                c = tl.arange(0, NSP)
                base = part_ptr + (row * n_seg + c) * (NP + 1)
                top_p = tl.load(top_p_ptr + row)
                lim = top_p.to(tl.float64) * tl.sum(tl.load(base, mask=c < n_seg, other=0.0, cache_modifier=".cg"), 0)
                tok = tl.full([], -2, tl.int64)
                for j in tl.static_range(NP):
                    _, t = _proposal(packed_ptr, row, n_prog, j, NP, NPP)
                    above = tl.sum(tl.load(base + 1 + j, mask=c < n_seg, other=0.0, cache_modifier=".cg"), 0)
                    tok = tl.where((tok == -2) & (above < lim), t, tok)
                if tok == -2:
                    mrow = -1
                    if HAS_MASK:
                        mrow = tl.load(mask_rows_ptr + row)
                    tok = rest_of_rule(logits_ptr, row, V, tl.load(inv_t_ptr + row), top_p,
                                       tl.load(keys_ptr + row).to(tl.uint32), m, lim, m, bitmask_ptr, mrow,
                                       bitmask_stride, HAS_MASK, NP, NMAX, LANES, LW, BLOCK, FAST, False, RPL)
        else:
            best, t = _proposal(packed_ptr, row, n_prog, 0, NP, NPP)
            tok = tl.where((best >> 32) > NEG_INF_KEY_C, t, -1)
    return tok


@triton.jit
def _reject_finish_kernel(logits_ptr, packed_ptr, pmax_ptr, part_ptr, out_ptr, inv_t_ptr, greedy_ptr, top_k_ptr,
                          top_p_ptr, keys_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, n_seg,
                          done_ptr, DONE: tl.constexpr, HAS_MASK: tl.constexpr, NP: tl.constexpr,
                          NPP: tl.constexpr, NSP: tl.constexpr, NMAX: tl.constexpr, LANES: tl.constexpr,
                          LW: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """Program (row): the row's token (`_row_token`)."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row, _row_token(logits_ptr, packed_ptr, pmax_ptr, part_ptr, row, inv_t_ptr, greedy_ptr,
                                       top_k_ptr, top_p_ptr, keys_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V,
                                       n_prog, n_seg, done_ptr, DONE, HAS_MASK, NP, NPP, NSP, NMAX, LANES, LW, BLOCK,
                                       FAST, min(LANES, 128)))


def reject_finish(logits, params, bitmask, mrows, packed, pmax, drawn, seg: int, lanes: int, np_: int,
                  interpreting: bool, lane_stats=None) -> torch.Tensor:
    """The tokens [R] int64 after a sampling pass with np_ proposals per program (packed [R, n_prog, np_], pmax
    [R, n_prog]): the mass-above pass over the top-p-alone rows, then the per-row finish. drawn: the top-k merge's
    tokens (-2: none) or None. lane_stats: [R, 2, n_lanes] lane maxima and masses from the pass (the mass-above
    pass then skips the lanes below every proposal), or None."""
    R, V = logits.shape
    n_prog = packed.shape[1]
    n_seg = triton.cdiv(V, seg)
    part = torch.empty((R, n_seg, np_ + 1), dtype=torch.float64, device=logits.device)
    has_mask = bitmask is not None
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else packed
    stride = bitmask.stride(0) if has_mask else 0
    warps = max(1, min(ABOVE_WARPS, lanes // 32))
    npp = max(16, triton.next_power_of_2(n_prog))
    nsp = max(16, triton.next_power_of_2(n_seg))
    out = empty((R,), torch.int64, logits.device)
    if STAGES < 1:
        return out
    common = dict(HAS_MASK=has_mask, NP=np_, NPP=npp, LANES=lanes, LW=seg // lanes, FAST=not interpreting,
                  DONE=drawn is not None, NSP=nsp, NMAX=NMAX, BLOCK=min(1024, triton.next_power_of_2(V)))
    above = dict(NPQ=triton.next_power_of_2(np_ + 1))
    fuse = FUSE_FINISH
    cnt = counts_workspace(R, logits.device) if fuse else None
    _above_kernel[(R, n_seg)](logits, packed, pmax, part, params.inv_temperature, params.greedy, params.top_k,
                              params.top_p, bm, mr, stride, V, n_prog, n_seg,
                              lane_stats if lane_stats is not None else pmax,
                              lane_stats.shape[2] if lane_stats is not None else 0, VEC=max(1, lanes // (32 * warps)),
                              SKIP=lane_stats is not None, out_ptr=out, keys_ptr=params.keys, done_ptr=drawn,
                              cnt_ptr=cnt, FUSE=fuse, num_warps=warps, **common, **above)
    if fuse or STAGES < 2:
        return out
    _reject_finish_kernel[(R,)](logits, packed, pmax, part, out, params.inv_temperature, params.greedy, params.top_k,
                                params.top_p, params.keys, bm, mr, stride, V, n_prog, n_seg, drawn,
                                num_warps=FINISH_WARPS, **common)
    return out


_COUNTS = {}


def counts_workspace(rows: int, device) -> torch.Tensor:
    """int32 [>= rows] zeros kept per device; every fused launch leaves it at zero (its last programs reset their
    row's count), so no call pays a reset launch. One stream at a time."""
    key = str(device)
    if key not in _COUNTS or _COUNTS[key].numel() < rows:
        _COUNTS[key] = torch.zeros(max(rows, 256), dtype=torch.int32, device=device)
    return _COUNTS[key]
