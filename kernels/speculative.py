"""Speculative acceptance for a whole batch: ratio test, residual distribution, bonus token.

Packed row layout (as the engine's verify forward produces it): request i owns rows [cu_rows[i], cu_rows[i+1]),
n_i = L_i + 1 rows; row j < L_i verifies draft d_{j+1} (draft_tokens[row]), the last row is the fresh row.
Every row's target distribution q is the processed distribution of kernels/sampling.py (bitmask, temperature,
top-k/top-p of its request), for the token at position[i] + j.

Rule (standard speculative sampling, exact):
- row j accepts its draft d iff u * p(d) < q(d), u = Uniform(seed, position + j, stream VERIFY) and p the draft
  distribution it was sampled from (draft_probs[row]; None = every draft was certain, p one-hot: grammar-forced
  drafts and greedy drafters). Greedy requests (T <= 0): accept iff d is q's argmax. d < 0 or d >= V: reject.
- accepted = the longest accepted prefix, n_acc in [0, L_i].
- final row f = first row after that prefix: if it rejected its draft, the final token is sampled from the
  residual max(q - p, 0) (stream RESIDUAL at position + n_acc; falls back to q if the residual is empty in
  floating point); if all drafts were accepted, f is the fresh row and the final token is a bonus sample from q
  with stream FRESH at position + n_acc, i.e. exactly what sample_from_logits would draw there.
Committed tokens of request i: tokens[cu_rows[i] : cu_rows[i] + n_acc + 1] (accepted drafts, then the final
token); the rest of its rows hold -1.

Draws (bonus, residual, and the q fallback of an empty residual) are the two-level segment draws of
kernels/sampling.py: the bonus is exactly sample_from_logits' draw for that row and position; the residual draw
runs the same rule on the weights max(q - p, 0), with segment score ln R_c + G_c (RESIDUAL stream). A top-p-alone
request's bonus follows kernels/rejection.py's rule with its tau known (the threshold path computes it): the
statistics pass draws its last row's proposals (rejection.PROPOSALS, or all NMAX when the host knows some such
request has p < rejection.P_MORE: sampling.proposal_count, the plain path's count) and the rule's last draw on
z >= tau; the accept kernel takes the first proposal with z >= tau, else the last draw. Only with 4 proposals in
the pass (p >= 0.85: all four miss with chance <= 5e-4) does it draw proposals 4 .. 7 by loops over the row;
before session 15 it also drew the last draw that way, and every p below 0.85 paid it when the first four missed.
Session 15 R3 (64 requests x 4 rows, peaked rows, drafts from q with probabilities q: every request draws its
bonus; .round script beside HEAD in the same run, us): p 0.5 233.4 / 233.5 on two input sets (3 / 2 bonus rows
missing the first four proposals) against HEAD's 634.6 / 500.2; p 0.9 (no such row) 172.0 against 177.0. Tokens =
twin on every request. (The rest of those calls is the histogram path's tau for top-p alone on 256 rows.)

Work (Triton path, `_accept_triton`, no host synchronisation, no torch ops on the parameters): four launches
when the host says no request filters, else first a per-row copy of the filter parameters (and each row's FRESH
key) and the top-k/top-p threshold launches. ONE statistics pass over all rows, per (row, part of a segment)
with the block in registers as in kernels/sampling.py (its program shape): the kept max and mass, plus the last
rows' bonus candidates and the greedy rows' argmax (each program finds its request from cu_rows and derives 1/T
and its rng key while its logits loads are in flight); the ratio test per request (merges the statistics, writes
the final token unless the final row rejected a draft); one residual pass over the final rows that rejected
(their logits + draft probabilities only; other programs exit); a tiny finish. Sampled rows with 0 < top_k <=
threshold.KMAX that have an allowed token and take the merge's gathered-lanes path (not its -1 bisection) get
their statistics from the top-k merge instead (kernels/threshold.py's lane path holds their kept set in the
lanes it gathered, and draws there with the row's FRESH key what the statistics pass would: its STATS), so the
statistics pass skips them without reading their logits again (session 10 R2, 64 requests x 4 rows with draft
probabilities, top-k50 p0.9, twice each against HEAD in the same run: 152.2 / 152.4 -> 101.9 / 102.0 us). Bytes:
every logits row once, plus logits and draft probabilities of the rejecting final rows.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import rng, sampling
from .backend import INTERPRETING, check, empty, use_triton
from .sampling import (LANES, LOG2E, NEG_INF, NEG_INF_KEY, SEG, SPEC_SHAPE, RowParams, check_logits_and_mask,
                       default_mask_rows, kept_z_torch, lane_draw_torch, lane_gumbel_torch, lane_scores_torch,
                       lanes_view, masked_z_torch, may_filter, one_launch_workspace, pass_shape, pick_lane,
                       rejection_draw_torch, row_params, segment_block, thresholds_torch)
from . import rejection
from .rejection import NMAX, is_p_alone, p_alone_rows, store_proposals
from .threshold import (exp2_w, lane_keys, lane_pick, lane_score, needs_histogram_path, pack_lanes, rescaled_mass,
                        thresholds_and_paths)


_NEG_INF_KEY = tl.constexpr(NEG_INF_KEY)


# (segment size, lanes per segment) of the draws, read at call time (kernels/sampling.py's rule; tests shrink it
# to cover several segments on a small vocabulary: the bonus draw equals sample_from_logits' only at the default)
LAYOUT = (SEG, LANES)
# the residual pass also finishes (atomic maxima per request, its last program): R2, 64 x 4 rows with draft
# probabilities, 49.1 / 49.2 us against 49.3 / 49.6 with the finish as its own launch
ONE_LAUNCH_RESIDUAL = True


@dataclass
class AcceptResult:
    num_accepted: torch.Tensor   # int64 [B]: accepted drafts per request
    tokens: torch.Tensor         # int64 [R]: committed tokens in packed row layout, -1 elsewhere
    final_tokens: torch.Tensor   # int64 [B]: the corrected or bonus token of each request (-1: nothing allowed)


@dataclass
class _Rows:
    """Per-row view of the per-request parameters."""
    req: torch.Tensor            # int64 [R] request of each row
    step: torch.Tensor           # int64 [R] local row index j
    n_rows: torch.Tensor         # int64 [R] rows of the row's request
    params: RowParams            # keys: FRESH stream at position + j
    seed: torch.Tensor
    pos: torch.Tensor


def _rows(cu_rows, R, temperature, top_k, top_p, seed, position) -> _Rows:
    from .sampling import row_params
    dev = cu_rows.device
    B = cu_rows.numel() - 1
    r = torch.arange(R, device=dev)
    req = torch.searchsorted(cu_rows[1:].contiguous(), r, right=True).clamp_max(max(B - 1, 0))
    step = r - cu_rows[req]
    n_rows = cu_rows[req + 1] - cu_rows[req]
    per_req = row_params(B, dev, temperature, top_k, top_p, seed, position)     # validates shapes
    seed_r = torch.as_tensor(seed, dtype=torch.int64, device=dev).expand(B)[req]
    pos_r = torch.as_tensor(position, dtype=torch.int64, device=dev).expand(B)[req] + step
    params = RowParams(per_req.inv_temperature[req], per_req.greedy[req], per_req.top_k[req],
                       per_req.top_p[req], rng.row_keys(seed_r, pos_r, rng.FRESH))
    return _Rows(req, step, n_rows, params, seed_r, pos_r)


def _accept_and_finalise(logits, rows: _Rows, tau, m, s, argmax, draft_tokens, draft_probs, bitmask, mrows, B):
    """The acceptance test (torch, [R] vectors) -> (n_acc [B], final row [B], residual? [B])."""
    R, V = logits.shape
    d = draft_tokens.to(torch.int64)
    valid = (d >= 0) & (d < V)
    dc = d.clamp(0, V - 1)
    r = torch.arange(R, device=logits.device)
    z_d = logits[r, dc].float() * rows.params.inv_temperature
    if bitmask is not None:
        word = bitmask[mrows.clamp_min(0), dc // 32]
        allowed = (((word >> (dc % 32).to(torch.int32)) & 1) != 0) | (mrows < 0)
        z_d = torch.where(allowed, z_d, torch.full_like(z_d, NEG_INF))
    kept = (z_d >= tau) & (z_d > NEG_INF)
    q_d = torch.where(kept, torch.exp(z_d - m) / s, torch.zeros_like(z_d))
    q_d = torch.where(rows.params.greedy, (dc == argmax).float(), q_d)
    p_d = torch.ones_like(q_d) if draft_probs is None else draft_probs[r, dc].float()
    u = rng.uniform(rng.row_keys(rows.seed, rows.pos, rng.VERIFY), torch.zeros_like(d))
    accept = valid & (u * p_d < q_d)
    fail = ~accept | (rows.step >= rows.n_rows - 1)
    big = torch.full((B,), 1 << 40, dtype=torch.int64, device=logits.device)
    n_acc = big.scatter_reduce(0, rows.req, torch.where(fail, rows.step, torch.full_like(rows.step, 1 << 40)),
                               reduce="amin")
    return n_acc


# ---------------------------------------------------------------------------------------------- torch twin
def _stats_torch(logits, params, bitmask, mrows):
    z = masked_z_torch(logits, params.inv_temperature, bitmask, mrows)
    tau = thresholds_torch(z, params)
    zk = z.masked_fill(z < tau[:, None], NEG_INF)
    m = zk.max(1).values
    s = torch.exp(zk - m.clamp_min(-3e38)[:, None]).sum(1)
    return tau, m, s, z.argmax(1)


def _final_torch(logits, params: RowParams, rows_f, draft_f, residual, draft_probs, bitmask, mrows, keys, m_f, s_f):
    """Final tokens of the rows rows_f: the residual draw where `residual`, else (and if the residual is empty in
    floating point) the q draw with the same keys. Both are the lane draws of kernels/sampling.py: q's on its
    weights exp(z - M_g), the residual's on max(q - p, 0) = max(exp(z - M_g) * exp(M_g - m) / s - p, 0), with
    lane score ln R_g + G_g."""
    sub = RowParams(params.inv_temperature[rows_f], params.greedy[rows_f], params.top_k[rows_f],
                    params.top_p[rows_f], keys)
    zk = kept_z_torch(logits[rows_f], sub, bitmask, None if mrows is None else mrows[rows_f])
    seg, lanes = LAYOUT
    score_q, k_q, ids = lane_scores_torch(zk, keys, seg, lanes)
    q_tok = pick_lane(score_q, k_q, ids)
    if draft_probs is None:
        p = torch.zeros_like(zk).scatter_(1, draft_f.clamp(0, zk.shape[1] - 1)[:, None], 1.0)
        p = torch.where((draft_f >= 0)[:, None], p, torch.zeros_like(p))
    else:
        p = draft_probs[rows_f].float()
    zl = lanes_view(zk, NEG_INF, seg, lanes)
    ml = zl.amax(-1)
    live = ml > NEG_INF
    w = torch.exp2(zl * LOG2E - (torch.where(live, ml, torch.zeros_like(ml)) * LOG2E)[..., None])
    kl = torch.where(live, torch.exp2((ml - m_f[:, None]) * LOG2E) / s_f[:, None], torch.zeros_like(ml))
    r = (w * kl[..., None] - lanes_view(p, 0.0, seg, lanes)).clamp_min(0.0)
    sr, k_r = lane_draw_torch(r, keys)
    r_score = torch.where(sr > 0, torch.log(sr.clamp_min(1e-30)) + lane_gumbel_torch(keys, zl.shape[1]),
                          torch.full_like(sr, NEG_INF))
    r_tok = pick_lane(r_score, k_r, ids)
    if sampling.P_REJECT:
        # a top-p-alone request's bonus (no residual: the FRESH keys) follows kernels/rejection.py's rule
        alone = p_alone_rows(sub, zk.shape[1]) & ~residual
        if bool(alone.any()):
            idx = alone.nonzero()[:, 0]
            z = masked_z_torch(logits[rows_f[idx]], sub.inv_temperature[idx], bitmask,
                               None if mrows is None else mrows[rows_f[idx]])
            q_tok = q_tok.clone()
            q_tok[idx] = rejection_draw_torch(z, RowParams(sub.inv_temperature[idx], sub.greedy[idx], sub.top_k[idx],
                                                           sub.top_p[idx], keys[idx]), seg, lanes)
    return torch.where(residual & (r_tok >= 0), r_tok, q_tok)


# ---------------------------------------------------------------------------------------------- Triton pieces
@triton.jit
def _request_of_row(cu_ptr, r, B, NB: tl.constexpr):
    """The request b whose rows [cu[b], cu[b+1]) hold row r: how many of cu[1..B] are <= r (one vector load of
    cu_rows and a block sum instead of a serial search)."""
    i = tl.arange(0, NB)
    cu = tl.load(cu_ptr + 1 + i, mask=i < B, other=4611686018427387904)
    return tl.sum((cu <= r).to(tl.int32), 0)


@triton.jit
def _request_params(temp_ptr, b):
    """(greedy, 1/T) of request b from its temperature, as sampling.row_params computes them (T <= 0: greedy,
    1/T = 1; IEEE division, like torch's)."""
    t = tl.load(temp_ptr + b)
    greedy = t <= 0
    return greedy, tl.where(greedy, 1.0, tl.math.div_rn(1.0, tl.where(greedy, 1.0, t)))


@triton.jit
def _stats_kernel(logits_ptr, mc_ptr, sc_ptr, pack_ptr, cu_ptr, temp_ptr, seed_ptr, pos_ptr, tau_ptr, bitmask_ptr,
                  mask_rows_ptr, bitmask_stride, V, n_prog, B, C_FRESH, HAS_MASK: tl.constexpr,
                  HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr, VEC: tl.constexpr,
                  NB: tl.constexpr, FAST: tl.constexpr, top_k_ptr=None, top_p_ptr=None, NP: tl.constexpr = 1,
                  solved_ptr=None, fin_ptr=None, NMAX: tl.constexpr = 8):
    """Program (row, part of a segment; the sampling pass's program shape): the kept max M_c and mass
    S_c = sum exp(z - M_c) of its PL lanes, and one packed candidate: greedy rows the first maximum; the last row
    of a non-greedy request its bonus draw (the lane rule, FRESH key at its position); other rows -inf (unused).
    The logits loads are issued first (with HAS_TAU after the row's solved flag and its branch: one dependent
    load more a program on filtered batches); the row's request and parameters are looked up while they are in
    flight (no per-row parameter arrays, no expand launch). Full segments skip the bounds checks. NP > 1: the last
    row of a top-p-alone request stores NP proposals instead (kernels/rejection.py's rule, on the unrestricted z;
    pack is [R, n_prog, NP]) and the rule's last draw (restricted to z >= tau, key NMAX) in fin[row, part].
    HAS_TAU (solved_ptr is None without it): rows the top-k merge solved (solved[row], threshold.lane_path's
    stats) already hold their statistics in part 0; their other parts get nothing (max -inf, mass 0, no
    candidate), and their logits are not read again."""
    skip = False
    if HAS_TAU:
        skip = tl.load(solved_ptr + tl.program_id(0)) != 0
    if skip:
        o = tl.program_id(0).to(tl.int64) * n_prog + tl.program_id(1)
        if tl.program_id(1) != 0:
            tl.store(mc_ptr + o, float("-inf"))
            tl.store(sc_ptr + o, 0.0)
            tl.store(pack_ptr + o * NP, -9223372036854775807)
    elif (tl.program_id(1) // (LANES // PL) + 1) * (LANES * LW) <= V:
        _stats_body(logits_ptr, mc_ptr, sc_ptr, pack_ptr, cu_ptr, temp_ptr, seed_ptr, pos_ptr, tau_ptr, bitmask_ptr,
                    mask_rows_ptr, bitmask_stride, V, n_prog, B, C_FRESH, HAS_MASK, HAS_TAU, True, LANES, LW, PL, VEC,
                    NB, FAST, top_k_ptr, top_p_ptr, NP, fin_ptr, NMAX)
    else:
        _stats_body(logits_ptr, mc_ptr, sc_ptr, pack_ptr, cu_ptr, temp_ptr, seed_ptr, pos_ptr, tau_ptr, bitmask_ptr,
                    mask_rows_ptr, bitmask_stride, V, n_prog, B, C_FRESH, HAS_MASK, HAS_TAU, False, LANES, LW, PL,
                    VEC, NB, FAST, top_k_ptr, top_p_ptr, NP, fin_ptr, NMAX)


@triton.jit
def _stats_body(logits_ptr, mc_ptr, sc_ptr, pack_ptr, cu_ptr, temp_ptr, seed_ptr, pos_ptr, tau_ptr, bitmask_ptr,
                mask_rows_ptr, bitmask_stride, V, n_prog, B, C_FRESH, HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr,
                FULL: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr, VEC: tl.constexpr,
                NB: tl.constexpr, FAST: tl.constexpr, top_k_ptr, top_p_ptr, NP: tl.constexpr, fin_ptr,
                NMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    prog = tl.program_id(1)
    seg = prog // (LANES // PL)
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    start, lane, pos, z = segment_block(logits_ptr, tau_ptr, bitmask_ptr, row, seg, 1.0, mrow, bitmask_stride, V,
                                       HAS_MASK, False, FULL, LANES, LW, PL, prog % (LANES // PL), VEC, FAST)
    b = _request_of_row(cu_ptr, row, B, NB)
    first = tl.load(cu_ptr + b)
    last = row == tl.load(cu_ptr + b + 1) - 1
    greedy, inv_t = _request_params(temp_ptr, b)
    alone = False
    if NP > 1:
        alone = last & is_p_alone(b, V, temp_ptr, top_k_ptr, top_p_ptr, True)
    z = z * inv_t
    zu = z
    if HAS_TAU:
        z = tl.where(z >= tl.load(tau_ptr + row), z, float("-inf"))
    ml = tl.max(z, 1)                                              # per lane, in-thread
    ref = tl.where(ml > float("-inf"), ml, 0.0) * 1.4426950408889634
    w = exp2_w(z * 1.4426950408889634 - ref[:, None], FAST)
    keys = lane_keys(tl.full([PL], float("-inf"), tl.float32), start + lane)
    if greedy:
        keys = lane_keys(ml, start + tl.min(tl.where(z == ml[:, None], pos, LANES * LW), 1))
    elif last:
        key = rng.row_key_tl(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + (row - first), C_FRESH)
        if alone:      # the bonus draw on z >= tau of a top-p-alone request: the rule's last draw, key NMAX
            key = rejection.proposal_key_tl(key, tl.full([], NMAX, tl.int32))
        gid = seg * LANES + lane
        sl, kk = lane_pick(w, gid, key, LW)
        keys = lane_keys(lane_score(ml, sl, key, gid, FAST), start + tl.minimum(kk, LW - 1) * LANES + lane)
    lane_mass = tl.sum(w, 1)
    m = tl.max(ml, 0)
    sm = rescaled_mass(ml, lane_mass, m)
    packed = tl.max(keys, 0)
    o = row * n_prog + prog
    tl.store(mc_ptr + o, m)
    tl.store(sc_ptr + o, sm)
    if NP > 1:
        if alone:
            key = rng.row_key_tl(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + (row - first), C_FRESH)
            store_proposals(zu, lane, pos, start, seg, 1.0, False, key, pack_ptr + o * NP, True, LANES, LW, FAST, NP)
            tl.store(fin_ptr + o, packed)
        else:
            tl.store(pack_ptr + o * NP, packed)
    else:
        tl.store(pack_ptr + o, packed)


@triton.jit
def _residual_kernel(logits_ptr, probs_ptr, rows_ptr, drafts_ptr, residual_ptr, keys_ptr, temp_ptr, tau_ptr,
                     m_ptr, s_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, res_ptr, q_ptr,
                     HAS_MASK: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_TAU: tl.constexpr, LANES: tl.constexpr,
                     LW: tl.constexpr, PL: tl.constexpr, VEC: tl.constexpr, FAST: tl.constexpr, cnt_ptr=None,
                     final_ptr=None, tokens_ptr=None, ONE: tl.constexpr = False):
    """Program (request, part of a segment) on a request whose final row rejected its draft (others exit at once):
    the candidates of the residual r = max(q - p, 0) and of q (the fallback when r is empty in floating point),
    both lane draws with the request's RESIDUAL key. Per token: q from the row's (m, s) and the lane max, the
    draft probability, a subtraction, two lane sums. Full segments skip the bounds checks."""
    if (tl.program_id(1) // (LANES // PL) + 1) * (LANES * LW) <= V:
        _residual_body(logits_ptr, probs_ptr, rows_ptr, drafts_ptr, residual_ptr, keys_ptr, temp_ptr, tau_ptr,
                       m_ptr, s_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, res_ptr, q_ptr,
                       HAS_MASK, HAS_PROBS, HAS_TAU, True, LANES, LW, PL, VEC, FAST, cnt_ptr, final_ptr, tokens_ptr,
                       ONE)
    else:
        _residual_body(logits_ptr, probs_ptr, rows_ptr, drafts_ptr, residual_ptr, keys_ptr, temp_ptr, tau_ptr,
                       m_ptr, s_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, res_ptr, q_ptr,
                       HAS_MASK, HAS_PROBS, HAS_TAU, False, LANES, LW, PL, VEC, FAST, cnt_ptr, final_ptr, tokens_ptr,
                       ONE)


@triton.jit
def _residual_body(logits_ptr, probs_ptr, rows_ptr, drafts_ptr, residual_ptr, keys_ptr, temp_ptr, tau_ptr,
                   m_ptr, s_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, res_ptr, q_ptr,
                   HAS_MASK: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_TAU: tl.constexpr, FULL: tl.constexpr,
                   LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr, VEC: tl.constexpr, FAST: tl.constexpr,
                   cnt_ptr, final_ptr, tokens_ptr, ONE: tl.constexpr):
    b = tl.program_id(0)
    prog = tl.program_id(1)
    seg = prog // (LANES // PL)
    if tl.load(residual_ptr + b) != 0:
        row = tl.load(rows_ptr + b)
        inv_t = _request_params(temp_ptr, b)[1]
        d = tl.load(drafts_ptr + b)
        key = tl.load(keys_ptr + b).to(tl.uint32)
        mrow = -1
        if HAS_MASK:
            mrow = tl.load(mask_rows_ptr + row)
        start, lane, pos, z = segment_block(logits_ptr, tau_ptr, bitmask_ptr, row, seg, inv_t, mrow, bitmask_stride,
                                           V, HAS_MASK, HAS_TAU, FULL, LANES, LW, PL, prog % (LANES // PL), VEC, FAST)
        if not HAS_TAU:
            z = z * inv_t
        ml = tl.max(z, 1)                                          # per lane, in-thread
        live = ml > float("-inf")
        w = exp2_w(z * 1.4426950408889634 - (tl.where(live, ml, 0.0) * 1.4426950408889634)[:, None], FAST)
        kl = tl.where(live, tl.exp2((ml - tl.load(m_ptr + row)) * 1.4426950408889634) / tl.load(s_ptr + row), 0.0)
        if HAS_PROBS:
            if FULL:
                p = tl.load(probs_ptr + row * V + start + pos).to(tl.float32)
            else:
                p = tl.load(probs_ptr + row * V + start + pos, mask=start + pos < V, other=0.0).to(tl.float32)
        else:
            p = tl.where(start + pos == d, 1.0, 0.0)
        gid = seg * LANES + lane
        sr, kr = lane_pick(tl.maximum(w * kl[:, None] - p, 0.0), gid, key, LW)
        g = rng.gumbel_tl(key, gid + 1610612736, FAST)                   # G_ID + g, as lane_score
        r_score = tl.where(sr > 0, tl.log(tl.maximum(sr, 1e-30)) + g, float("-inf"))
        sq, kq = lane_pick(w, gid, key, LW)
        rbest = pack_lanes(r_score, start + tl.minimum(kr, LW - 1) * LANES + lane)
        qbest = pack_lanes(lane_score(ml, sq, key, gid, FAST), start + tl.minimum(kq, LW - 1) * LANES + lane)
        if ONE:
            # the finish in this launch: atomic maxima per request into a self-cleaning workspace; the request's
            # last program (acq_rel count) takes both winners, resets the words and the count, writes the token
            tl.atomic_max(res_ptr + 2 * b, rbest, sem="relaxed")
            tl.atomic_max(res_ptr + 2 * b + 1, qbest, sem="relaxed")
            if tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel") == n_prog - 1:
                rbest = tl.atomic_xchg(res_ptr + 2 * b, -9223372036854775807, sem="relaxed")
                qbest = tl.atomic_xchg(res_ptr + 2 * b + 1, -9223372036854775807, sem="relaxed")
                tl.store(cnt_ptr + b, 0)
                _final_from_winners(rbest, qbest, b, rows_ptr, final_ptr, tokens_ptr)
        else:
            o = b * n_prog + prog
            tl.store(res_ptr + o, rbest)
            tl.store(q_ptr + o, qbest)


@triton.jit
def _expand_rows_kernel(cu_ptr, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, pos_ptr, row_inv_t_ptr, row_greedy_ptr,
                        row_top_k_ptr, row_top_p_ptr, row_keys_ptr, C_FRESH, NR: tl.constexpr):
    """Program (request): its filter parameters on each of its rows (what the threshold kernels read; only when
    some request may filter), and each row's FRESH key at its position (the top-k merge draws the bonus with it,
    as the statistics pass would)."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    greedy, inv_t = _request_params(temp_ptr, b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    seed = tl.load(seed_ptr + b)
    pos0 = tl.load(pos_ptr + b)
    for j0 in range(0, n, NR):
        j = j0 + tl.arange(0, NR)
        ok = j < n
        r = start + j
        tl.store(row_inv_t_ptr + r, inv_t + tl.zeros([NR], tl.float32), mask=ok)
        tl.store(row_greedy_ptr + r, greedy.to(tl.int8) + tl.zeros([NR], tl.int8), mask=ok)
        tl.store(row_top_k_ptr + r, top_k + tl.zeros([NR], tl.int64), mask=ok)
        tl.store(row_top_p_ptr + r, top_p + tl.zeros([NR], tl.float32), mask=ok)
        tl.store(row_keys_ptr + r, rng.row_key_tl(seed, pos0 + j, C_FRESH).to(tl.int64), mask=ok)


@triton.jit
def _merge(mc_ptr, sc_ptr, pack_ptr, ro, n_seg, NCP: tl.constexpr, NP: tl.constexpr = 1, j=0):
    """A row's (m, s, packed best) from its parts' (M_c, S_c, candidate j of NP)."""
    c = tl.arange(0, NCP)
    mc = tl.load(mc_ptr + ro * n_seg + c, mask=c < n_seg, other=float("-inf"))
    sc = tl.load(sc_ptr + ro * n_seg + c, mask=c < n_seg, other=0.0)
    best = tl.max(tl.load(pack_ptr + (ro * n_seg + c) * NP + j, mask=c < n_seg, other=-9223372036854775807), 0)
    m = tl.max(mc, 0)
    s = rescaled_mass(mc, sc, m)
    return m, s, best


@triton.jit
def _accept_kernel(logits_ptr, probs_ptr, drafts_ptr, cu_ptr, seed_ptr, pos_ptr, temp_ptr, tau_ptr,
                   mc_ptr, sc_ptr, pack_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_seg,
                   m_ptr, s_ptr, n_acc_ptr, rows_f_ptr, draft_f_ptr, residual_ptr, keys_f_ptr, tokens_ptr, final_ptr,
                   C_VERIFY, C_RESIDUAL, HAS_MASK: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_TAU: tl.constexpr,
                   NCP: tl.constexpr, NR: tl.constexpr, top_k_ptr=None, top_p_ptr=None, C_FRESH=0,
                   NP: tl.constexpr = 1, NMAX: tl.constexpr = 8, LANES: tl.constexpr = 256, LW: tl.constexpr = 16,
                   BLOCK: tl.constexpr = 1024, FAST: tl.constexpr = True, fin_ptr=None):
    """Program (request): merge its rows' statistics and run the ratio test of NR rows at a time (all their loads
    in flight together; the rows of a chunk are independent), up to the first rejection; write the accepted
    drafts (-1 on the other rows). A request that needs no residual (all drafts accepted: the bonus draw of its
    last row; greedy: the argmax of its final row) gets its final token here; the others get the residual
    pass's inputs. NP > 1: a top-p-alone request's bonus is its first proposal inside the top-p set
    (kernels/rejection.py; z >= tau: the tau is known here), else the rest of the rule (`_bonus_by_rejection`)."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    seed = tl.load(seed_ptr + b)
    pos0 = tl.load(pos_ptr + b)
    greedy, inv_t = _request_params(temp_ptr, b)
    n_acc = n - 1
    jj = tl.arange(0, NR)
    c = tl.arange(0, NCP)
    bests = tl.full([NR], -9223372036854775807, tl.int64)            # the first chunk's packed winners
    for j0 in range(0, n, NR):
        j = j0 + jj
        live = j < n
        r = start + j
        ro = r.to(tl.int64)
        test = live & (j < n - 1)                                  # rows that verify a draft
        d = tl.load(drafts_ptr + r, mask=test, other=-1)
        o = ro[:, None] * n_seg + c[None, :]
        okc = live[:, None] & (c[None, :] < n_seg)
        mc = tl.load(mc_ptr + o, mask=okc, other=float("-inf"))
        sc = tl.load(sc_ptr + o, mask=okc, other=0.0)
        best = tl.max(tl.load(pack_ptr + o * NP, mask=okc, other=-9223372036854775807), 1)
        if j0 == 0:
            bests = best
        m = tl.max(mc, 1)
        s = rescaled_mass(mc, sc, m[:, None], 1)
        tl.store(m_ptr + r, m, mask=live)
        tl.store(s_ptr + r, s, mask=live)
        dc = tl.minimum(tl.maximum(d, 0), V - 1)
        z = tl.load(logits_ptr + ro * V + dc, mask=test, other=0.0).to(tl.float32) * inv_t
        if HAS_MASK:
            mrow = tl.load(mask_rows_ptr + r, mask=test, other=-1)
            w = tl.load(bitmask_ptr + tl.maximum(mrow, 0) * bitmask_stride + dc // 32, mask=test, other=-1)
            z = tl.where((((w >> (dc % 32).to(tl.int32)) & 1) != 0) | (mrow < 0), z, float("-inf"))
        kept = z > float("-inf")
        if HAS_TAU:
            kept = kept & (z >= tl.load(tau_ptr + r, mask=test, other=0.0))
        q = tl.where(kept, tl.exp(z - m) / s, 0.0)
        amax = 4294967295 - (best & 4294967295)                    # greedy rows: the first maximum
        q = tl.where(greedy, tl.where((dc == amax) & ((best >> 32) > _NEG_INF_KEY), 1.0, 0.0), q)
        p = tl.full([NR], 1.0, tl.float32)
        if HAS_PROBS:
            p = tl.load(probs_ptr + ro * V + dc, mask=test, other=1.0).to(tl.float32)
        u = rng.uniform_tl(rng.row_key_tl(seed, pos0 + j, C_VERIFY), jj * 0)               # id 0, as the twin
        reject = test & ((d < 0) | (d >= V) | (u * p >= q))
        n_acc = tl.minimum(n_acc, tl.min(tl.where(reject, j, n - 1), 0))
    for j0 in range(0, n, NR):
        j = j0 + jj
        d = tl.load(drafts_ptr + start + j, mask=j < n, other=-1)
        tl.store(tokens_ptr + start + j, tl.where(j < n_acc, d, -1), mask=j < n)
    rows_f = start + n_acc
    residual = (n_acc < n - 1) & (not greedy)
    tl.store(n_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(rows_f_ptr + b, rows_f.to(tl.int64))
    tl.store(draft_f_ptr + b, tl.where(n_acc < n - 1, tl.load(drafts_ptr + rows_f), -1))
    tl.store(residual_ptr + b, residual.to(tl.int8))
    tl.store(keys_f_ptr + b, rng.row_key_tl(seed, pos0 + n_acc, C_RESIDUAL).to(tl.int64))
    if not residual:
        if n_acc < NR:          # the final row's winner was loaded with the first chunk (no second round trip)
            best = tl.max(tl.where(jj == n_acc, bests, -9223372036854775807), 0)
        else:
            best = _merge(mc_ptr, sc_ptr, pack_ptr, rows_f.to(tl.int64), n_seg, NCP, NP)[2]
        tok = tl.where((best >> 32) > _NEG_INF_KEY, 4294967295 - (best & 4294967295), -1)
        if NP > 1:
            if is_p_alone(b, V, temp_ptr, top_k_ptr, top_p_ptr, True):
                tok = _bonus_by_rejection(logits_ptr, pack_ptr, fin_ptr, tau_ptr, bitmask_ptr, mask_rows_ptr,
                                          bitmask_stride, rows_f.to(tl.int64), V, n_seg, inv_t,
                                          rng.row_key_tl(seed, pos0 + n_acc, C_FRESH), HAS_MASK, NCP, NP, NMAX,
                                          LANES, LW, BLOCK, FAST)
        tl.store(final_ptr + b, tok)
        tl.store(tokens_ptr + rows_f, tok)


@triton.jit
def _bonus_by_rejection(logits_ptr, pack_ptr, fin_ptr, tau_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, rf, V,
                        n_seg, inv_t, key, HAS_MASK: tl.constexpr, NCP: tl.constexpr, NP: tl.constexpr,
                        NMAX: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, BLOCK: tl.constexpr,
                        FAST: tl.constexpr):
    """The bonus token of a top-p-alone request (its final row rf): the first of the stats pass's NP proposals
    with z >= tau; else proposals NP .. NMAX - 1 by loops over the row (none when the pass drew all NMAX, as it does
    when the host knows some such request has p < rejection.P_MORE); else the rule's last draw, which the stats
    pass made too (fin: restricted to z >= tau, key NMAX); -1 if nothing is allowed."""
    tau = tl.load(tau_ptr + rf)
    tok = tl.full([], -2, tl.int64)
    alive = False
    for j in tl.static_range(NP):
        best, t = rejection._proposal(pack_ptr, rf, n_seg, j, NP, NCP)
        live = (best >> 32) > _NEG_INF_KEY
        alive = alive | live
        zt = tl.load(logits_ptr + rf * V + tl.where(live, t, 0)).to(tl.float32) * inv_t
        tok = tl.where((tok == -2) & live & (zt >= tau), t, tok)
    if not alive:
        tok = tl.full([], -1, tl.int64)
    if tok == -2:
        mrow = -1
        if HAS_MASK:
            mrow = tl.load(mask_rows_ptr + rf)
        tok = rejection._more_proposals(logits_ptr, rf, V, inv_t, key, tau, tau, tau, bitmask_ptr, mrow,
                                        bitmask_stride, HAS_MASK, NP, NMAX, LANES, LW, BLOCK, FAST, True,
                                        min(LANES, 32))
    if tok == -2:
        best = rejection._proposal(fin_ptr, rf, n_seg, 0, 1, NCP)[0]
        tok = tl.where((best >> 32) > _NEG_INF_KEY, rejection._unpack(best), -1)
    return tok


@triton.jit
def _final_from_winners(rbest, qbest, b, rows_f_ptr, final_ptr, tokens_ptr):
    """A residual request's final token from the packed winners (the residual's, else q's), also written into the
    packed tokens at its final row."""
    r_tok = tl.where((rbest >> 32) > _NEG_INF_KEY, rejection._unpack(rbest), -1)
    q_tok = tl.where((qbest >> 32) > _NEG_INF_KEY, rejection._unpack(qbest), -1)
    tok = tl.where(r_tok >= 0, r_tok, q_tok)
    tl.store(final_ptr + b, tok)
    tl.store(tokens_ptr + tl.load(rows_f_ptr + b), tok)


@triton.jit
def _finish_residual_kernel(res_ptr, q_ptr, rows_f_ptr, residual_ptr, final_ptr, tokens_ptr, n_seg,
                            BLOCK: tl.constexpr):
    """Program (request) with a residual: its final token (`_final_from_winners` on the maxima of its parts)."""
    b = tl.program_id(0).to(tl.int64)
    if tl.load(residual_ptr + b) != 0:
        c = tl.arange(0, BLOCK)
        lowest = -9223372036854775807
        rbest = tl.max(tl.load(res_ptr + b * n_seg + c, mask=c < n_seg, other=lowest), 0)
        qbest = tl.max(tl.load(q_ptr + b * n_seg + c, mask=c < n_seg, other=lowest), 0)
        _final_from_winners(rbest, qbest, b, rows_f_ptr, final_ptr, tokens_ptr)


def _accept_triton(logits, cu_rows, draft_tokens, draft_probs, temperature, top_k, top_p, seed, position, bitmask,
                   mrows, stages=9, filters=None, histogram=None, shape=None, reject=None, proposals=None):
    """The whole acceptance step in four launches when the host says no request filters (statistics pass with
    the bonus draws, ratio test, residual pass, residual finish), three more otherwise (per-row filter
    parameters, then the top-k/top-p thresholds: kernels/threshold.py, whose top-k merge also writes its rows'
    statistics for the statistics pass to skip), no host synchronisation, no torch ops
    on the parameters (each kernel derives 1/T, greedy and its rng keys from the per-request tensors).
    temperature, top_k, top_p, seed, position: per-request device tensors [B]. shape: the pass's program shape
    (sampling.pass_shape). stages < 9 stops after that many launches (benchmarks time the stages by
    differences; the result is then unfinished). reject=False: the host knows no request is top-p alone (their
    bonus is drawn by kernels/rejection.py's rule: the stats pass then stores `proposals` draws per program,
    default rejection.PROPOSALS, and the rule's last draw)."""
    R, V = logits.shape
    B = cu_rows.numel() - 1
    dev = logits.device
    has_tau = filters is not False
    tau = logits
    seg, lanes = LAYOUT
    pl, warps, vec = pass_shape(lanes, shape or SPEC_SHAPE)
    n_prog = triton.cdiv(V, seg) * (lanes // pl)
    mc = torch.empty((R, n_prog), dtype=torch.float32, device=dev)
    sc = torch.empty_like(mc)
    np_ = (proposals or rejection.PROPOSALS) if has_tau and sampling.P_REJECT and reject is not False else 1
    pack = torch.empty((R, n_prog, np_), dtype=torch.int64, device=dev)
    fin = torch.empty((R, n_prog) if np_ > 1 else (1,), dtype=torch.int64, device=dev)
    solved = None                                               # rows whose statistics the top-k merge wrote
    if has_tau:
        solved = torch.empty(R, dtype=torch.int8, device=dev)
        rows = RowParams(torch.empty(R, dtype=torch.float32, device=dev),
                         torch.empty(R, dtype=torch.int8, device=dev),
                         torch.empty(R, dtype=torch.int64, device=dev), torch.empty(R, dtype=torch.float32, device=dev),
                         torch.empty(R, dtype=torch.int64, device=dev))
        _expand_rows_kernel[(B,)](cu_rows, temperature, top_k, top_p, seed, position, rows.inv_temperature,
                                  rows.greedy, rows.top_k, rows.top_p, rows.keys, rng.stream_constant(rng.FRESH),
                                  NR=8, num_warps=1)
        tau = thresholds_and_paths(logits, rows, bitmask, mrows, histogram=histogram, draw=(seg, lanes),
                                   stats=(mc, sc, pack, solved))[0]
    if stages < 6:
        return None
    has_mask, has_probs = bitmask is not None, draft_probs is not None
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else cu_rows
    stride = bitmask.stride(0) if has_mask else 0
    consts = dict(HAS_MASK=has_mask, HAS_TAU=has_tau, LANES=lanes, LW=seg // lanes, PL=pl, VEC=vec,
                  FAST=not INTERPRETING)
    _stats_kernel[(R, n_prog)](logits, mc, sc, pack, cu_rows, temperature, seed, position, tau, bm, mr, stride, V,
                               n_prog, B, rng.stream_constant(rng.FRESH), NB=max(16, triton.next_power_of_2(B)),
                               top_k_ptr=top_k, top_p_ptr=top_p, NP=np_, solved_ptr=solved, fin_ptr=fin, NMAX=NMAX,
                               num_warps=warps, **consts)
    if stages < 7:
        return None
    m = torch.empty(R, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    n_acc = empty((B,), torch.int64, dev)
    rows_f = torch.empty(B, dtype=torch.int64, device=dev)
    draft_f = torch.empty(B, dtype=torch.int64, device=dev)
    residual = torch.empty(B, dtype=torch.int8, device=dev)
    keys_f = torch.empty(B, dtype=torch.int64, device=dev)
    tokens = empty((R,), torch.int64, dev)
    final = empty((B,), torch.int64, dev)
    ncp = max(16, triton.next_power_of_2(n_prog))
    _accept_kernel[(B,)](logits, draft_probs if has_probs else logits, draft_tokens, cu_rows, seed, position,
                         temperature, tau, mc, sc, pack, bm, mr, stride, V, n_prog, m, s,
                         n_acc, rows_f, draft_f, residual, keys_f, tokens, final, rng.stream_constant(rng.VERIFY),
                         rng.stream_constant(rng.RESIDUAL), HAS_MASK=has_mask, HAS_PROBS=has_probs, HAS_TAU=has_tau,
                         NCP=ncp, NR=8, top_k_ptr=top_k, top_p_ptr=top_p, C_FRESH=rng.stream_constant(rng.FRESH),
                         NP=np_, NMAX=NMAX, LANES=lanes, LW=seg // lanes, BLOCK=min(1024, triton.next_power_of_2(V)),
                         FAST=not INTERPRETING, fin_ptr=fin, num_warps=1)
    if stages < 8:
        return None
    one = ONE_LAUNCH_RESIDUAL
    if one:
        res_c, cnt = one_launch_workspace(2 * B, dev)
        q_c = res_c
    else:
        res_c = torch.empty((B, n_prog), dtype=torch.int64, device=dev)
        q_c, cnt = torch.empty_like(res_c), None
    _residual_kernel[(B, n_prog)](
        logits, draft_probs if has_probs else logits, rows_f, draft_f, residual, keys_f, temperature, tau,
        m, s, bm, mr, stride, V, n_prog, res_c, q_c, HAS_PROBS=has_probs, cnt_ptr=cnt, final_ptr=final,
        tokens_ptr=tokens, ONE=one, num_warps=warps, **consts)
    if stages < 9 or one:
        return None if stages < 9 else AcceptResult(n_acc, tokens, final)
    _finish_residual_kernel[(B,)](res_c, q_c, rows_f, residual, final, tokens, n_prog, BLOCK=ncp, num_warps=1)
    return AcceptResult(n_acc, tokens, final)


# ---------------------------------------------------------------------------------------------- dispatch
def speculative_accept(logits: torch.Tensor, cu_rows: torch.Tensor, draft_tokens: torch.Tensor,
                       draft_probs: torch.Tensor | None, temperature, top_k, top_p, seed, position,
                       bitmask: torch.Tensor | None = None, mask_rows=None, backend: str = "auto",
                       filters: bool | None = None, histogram: bool | None = None) -> AcceptResult:
    """Verify packed draft rows for a batch of requests (module docstring has the exact rule).

    logits fp32 [R, V] (packed rows); cu_rows int64 [B+1] (cu_rows[0] = 0, cu_rows[B] = R, every request >= 1
    row); draft_tokens int64 [R] (entries on fresh rows ignored); draft_probs [R, V] fp32 or None (one-hot
    drafts); temperature/top_k/top_p/seed/position: scalars or [B] (position: of the token row 0 predicts);
    bitmask/mask_rows as in sample_from_logits (per row; e.g. kernels.bitmask.by_step_mask_rows). backend:
    "auto" (Triton on CUDA), "triton" or "torch". filters: whether any request uses top-k/top-p, when the caller
    knows it but passes the parameters as device tensors (host values are inspected here; device tensors
    otherwise mean "maybe": the threshold kernels then run and exit on rows without filters, ~30 us at 256 rows);
    histogram likewise: whether some request filters by top-p alone or top_k > threshold.KMAX.
    """
    check_logits_and_mask(logits, bitmask, mask_rows)
    R, V = logits.shape
    cu_rows = torch.as_tensor(cu_rows, device=logits.device).to(torch.int64).contiguous()
    check(cu_rows.dim() == 1 and cu_rows.numel() >= 2, f"cu_rows must be [B+1] with B >= 1, got {tuple(cu_rows.shape)}")
    draft_tokens = torch.as_tensor(draft_tokens, device=logits.device).to(torch.int64).contiguous()
    check(draft_tokens.shape == (R,), f"draft_tokens must be [{R}] (one per row), got {tuple(draft_tokens.shape)}")
    if draft_probs is not None:
        check(draft_probs.shape == (R, V) and draft_probs.is_contiguous(),
              f"draft_probs must be contiguous [{R}, {V}], got {tuple(draft_probs.shape)}")
    if not logits.is_cuda:
        check(int(cu_rows[0]) == 0 and int(cu_rows[-1]) == R and bool((cu_rows.diff() >= 1).all()),
              f"cu_rows must start at 0, end at {R} and give every request >= 1 row, got {cu_rows.tolist()}")
    B = cu_rows.numel() - 1
    mrows = default_mask_rows(mask_rows, R, logits.device) if bitmask is not None else None
    triton_path = use_triton(logits) if backend == "auto" else backend == "triton"
    if triton_path:
        from .sampling import _per_row
        reject = proposals = None
        # device tensors stay where they are (no host copies: the step can be captured in a CUDA graph); the
        # kernels derive 1/T, greedy and the rng keys themselves (no torch ops on the parameters)
        dev = logits.device
        seed = _per_row(seed, B, torch.int64, dev, "seed")
        position = _per_row(position, B, torch.int64, dev, "position")
        if not any(isinstance(x, torch.Tensor) and x.is_cuda for x in (temperature, top_k, top_p)):
            host = row_params(B, "cpu", temperature, top_k, top_p, 0, 0)        # validates on the host
            filters = may_filter(host, V) if filters is None else filters
            histogram = needs_histogram_path(host, V) if histogram is None else histogram
            alone = p_alone_rows(host, V)
            reject = bool(alone.any())
            proposals = sampling.proposal_count(host, V, alone)
        temperature = _per_row(temperature, B, torch.float32, dev, "temperature")
        top_k = _per_row(top_k, B, torch.int64, dev, "top_k")
        top_p = _per_row(top_p, B, torch.float32, dev, "top_p")
        return _accept_triton(logits, cu_rows, draft_tokens, draft_probs, temperature, top_k, top_p, seed, position,
                              bitmask, mrows, filters=filters, histogram=histogram, reject=reject,
                              proposals=proposals)
    rows = _rows(cu_rows, R, temperature, top_k, top_p, seed, position)
    tau, m, s, argmax = _stats_torch(logits, rows.params, bitmask, mrows)
    n_acc = _accept_and_finalise(logits, rows, tau, m, s, argmax, draft_tokens, draft_probs, bitmask, mrows, B)
    n_rows = cu_rows[1:] - cu_rows[:-1]
    rows_f = cu_rows[:-1] + n_acc
    residual = n_acc < n_rows - 1
    draft_f = torch.where(residual, draft_tokens[rows_f], torch.full_like(n_acc, -1))
    pos_f = rows.pos[rows_f]
    seed_f = rows.seed[rows_f]
    keys = torch.where(residual, rng.row_keys(seed_f, pos_f, rng.RESIDUAL), rng.row_keys(seed_f, pos_f, rng.FRESH))
    final = _final_torch(logits, rows.params, rows_f, draft_f, residual, draft_probs, bitmask, mrows, keys,
                         m[rows_f], s[rows_f])
    greedy_f = rows.params.greedy[rows_f]
    final = torch.where(greedy_f, torch.where(m[rows_f] > NEG_INF, argmax[rows_f], -1), final)
    tokens = torch.where(rows.step < n_acc[rows.req], draft_tokens, torch.full_like(draft_tokens, -1))
    tokens = tokens.scatter(0, rows_f, final)
    return AcceptResult(n_acc, tokens, final)
